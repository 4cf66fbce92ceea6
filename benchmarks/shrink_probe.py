"""What a prefill shrink could reach (GPU): the skinny GEMM out = x @ A^T with x's rows
consecutive (one adapter, one sequence), timed three ways beside the byte floor and cuBLAS:

  lorafleet   kernels.lora_shrink, n = 1 (the segmented kernel, rows gathered)
  ptr         a plain split-K Triton GEMM, rows consecutive, pointer loads (cp.async)
  tma         the same GEMM, x and A read through TMA tensor descriptors

with --decode, what a decode-sized call costs at the least (an empty kernel; a kernel
that only streams the A bytes of the shape), and with --ab the plain GEMM with the
segmented kernel's habits added one at a time (rows through an index vector, shuffled,
K splits side by side) beside kernels.lora_shrink per tile height and config. All in
CUDA-graph replay, bf16, inputs rotated past L2.

    python3 benchmarks/shrink_probe.py --decode --ab --out benchmarks/results/shrink_probe_h200.json

A probe, not a kernel of the library: it found that TMA loads do not pay for the prefill
shrink and that scalar fp32 atomics did (benchmarks/README.md, "Probes";
results/shrink_probe_h200.json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lora_bench import (  # noqa: E402
    LAYERS,
    POOL_SLOTS,
    Pools,
    call_shrink,
    floor_bytes,
    make_sets,
    probe_header,
    time_graph,
    workspaces,
)

from kernels import SegmentMeta, build_meta, lora_shrink  # noqa: E402

# (name, H, N): N = slices x rank, A stacked as one [N, H] (all slices read with one x tile)
PREFILL = [
    ("o r16", 4096, 16),
    ("qkv r16", 4096, 48),
    ("down r16", 14336, 16),
    ("qkv r64", 4096, 192),
]
TOKENS = 4096
ROTATE_BYTES = 180e6


@triton.jit
def _gemm_kernel(
    x_desc, a_desc, x_ptr, a_ptr, out_ptr, N, stride_x, stride_a, k_per_split, rows_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    TMA: tl.constexpr, ATOMIC: tl.constexpr, GATHER: tl.constexpr = False,
    SPLIT_FAST: tl.constexpr = False,
):  # fmt: skip
    """out[m, n] (+)= sum_{k in this split} x[m, k] * A[n, k]; T % BLOCK_M == 0, H % BLOCK_K == 0.
    GATHER: x's rows through the index vector rows_ptr (as the segmented kernels read
    them); SPLIT_FAST: the K split is grid axis 0 (consecutive programs: one row tile's
    splits, as in kernels.lora_shrink), else axis 2."""
    m0 = tl.program_id(2 if SPLIT_FAST else 0) * BLOCK_M
    n0 = tl.program_id(1) * BLOCK_N
    k0 = tl.program_id(0 if SPLIT_FAST else 2) * k_per_split
    offs_m = m0 + tl.arange(0, BLOCK_M)
    x_rows = offs_m
    if GATHER:
        x_rows = tl.load(rows_ptr + offs_m)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k0, k0 + k_per_split, BLOCK_K):
        if TMA:
            xv = x_desc.load([m0, k])
            av = a_desc.load([n0, k])
        else:
            xv = tl.load(x_ptr + x_rows[:, None] * stride_x + (k + offs_k)[None, :])
            av = tl.load(
                a_ptr + offs_n[:, None] * stride_a + (k + offs_k)[None, :],
                mask=(offs_n < N)[:, None],
                other=0.0,
            )
        acc += tl.dot(xv, tl.trans(av))
    ptrs = out_ptr + offs_m[:, None] * N + offs_n[None, :]
    mask = (offs_n < N)[None, :]
    if ATOMIC:
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, acc, mask=mask)


def gemm(x, a, out, cfg, rows=None, split_fast=False):
    """out (zeroed fp32 [T, N]) += x @ a^T under cfg = (tma, BM, BN, BK, stages, split);
    rows: x's rows read through this int32 index vector (GATHER)."""
    tma, bm, bn, bk, stages, split = cfg
    tokens, hidden = x.shape
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk]) if tma else x
    a_desc = TensorDescriptor.from_tensor(a, [bn, bk]) if tma else a
    k_per_split = hidden // split
    grid = (tokens // bm, triton.cdiv(a.shape[0], bn), split)
    if split_fast:
        grid = grid[::-1]
    _gemm_kernel[grid](
        x_desc, a_desc, x, a, out, a.shape[0], x.stride(0), a.stride(0), k_per_split,
        x if rows is None else rows,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, TMA=tma, ATOMIC=split > 1,
        GATHER=rows is not None, SPLIT_FAST=split_fast, num_warps=4, num_stages=stages,
    )  # fmt: skip


def _zero(tensors) -> None:
    for t in tensors:
        t.zero_()


def _const(value, _index):
    return value


def configs(n: int, hidden: int):
    bns = [max(16, triton.next_power_of_2(n))] if n <= 64 else [64, 256]
    for bn, (bm, bk), stages, split, tma in itertools.product(
        bns, ((64, 128), (128, 64), (128, 128)), (3, 5), (1, 2, 4), (True, False)
    ):
        if hidden % (split * bk) == 0:
            yield (tma, bm, bn, bk, stages, split)


def _gemm_inputs(hidden: int, n: int, bw: float):
    """(x sets rotated past L2, A [n, H], zeroed fp32 outputs per set, byte floor in us)."""
    nsets = max(1, round(ROTATE_BYTES / (TOKENS * hidden * 2)))
    xs = [torch.randn(TOKENS, hidden, device="cuda").to(torch.bfloat16) for _ in range(nsets)]
    a = (torch.randn(n, hidden, device="cuda") * hidden**-0.5).to(torch.bfloat16)
    outs = [torch.zeros(TOKENS, n, device="cuda") for _ in range(nsets)]
    floor_us = (TOKENS * hidden * 2 + n * hidden * 2 + TOKENS * n * 4) / bw * 1e6
    return xs, a, outs, floor_us


def _one_adapter_meta(rank: int, block_m: int | None = None) -> SegmentMeta:
    """SegmentMeta of TOKENS tokens all on slot 0 (one adapter: one run of consecutive rows)."""
    slots = torch.zeros(TOKENS, dtype=torch.int64, device="cuda")
    empty = SegmentMeta.empty(TOKENS, POOL_SLOTS, slots.device, block_m, max_rank=rank)
    return build_meta(slots, POOL_SLOTS, out=empty)


def probe_prefill(bw: float, budget_s: float) -> list[dict]:
    rows = []
    for name, hidden, n in PREFILL:
        xs, a, outs, floor_us = _gemm_inputs(hidden, n, bw)
        want = xs[0].double() @ a.double().t()
        row = {"shape": name, "T": TOKENS, "H": hidden, "N": n, "floor_us": floor_us}
        row["cublas_us"] = time_graph([partial(torch.mm, x, a.t()) for x in xs])
        row["lorafleet_us"] = _lorafleet(name, hidden, n, xs)
        best = {}
        start = time.time()
        for cfg in configs(n, hidden):
            if time.time() - start > budget_s:
                break
            try:
                outs[0].zero_()
                gemm(xs[0], a, outs[0], cfg)
                torch.cuda.synchronize()
            except Exception as err:  # noqa: BLE001 - a config past shared memory: skip it
                print(f"  skip {cfg}: {type(err).__name__}", flush=True)
                continue
            err = ((outs[0].double() - want).abs().max() / want.abs().max()).item()
            if err > 2e-2:
                raise AssertionError(f"{name} {cfg}: relative error {err:.3g}")
            us = time_graph(
                [partial(gemm, x, a, o, cfg) for x, o in zip(xs, outs, strict=True)],
                prologue=partial(_zero, outs),
            )
            key = "tma" if cfg[0] else "ptr"
            print(f"  {name} {key} {cfg[1:]}: {us:.1f} us (floor {floor_us:.1f})", flush=True)
            if key not in best or us < best[key][0]:
                best[key] = (us, cfg[1:])
        for key, (us, cfg) in best.items():
            row[f"{key}_us"] = us
            row[f"{key}_config_bm_bn_bk_stages_split"] = list(cfg)
        print(
            f"{name}: floor {floor_us:.1f} us | cuBLAS {row['cublas_us']:.1f} | lorafleet "
            f"{row['lorafleet_us']:.1f} | ptr {row.get('ptr_us', float('nan')):.1f} | "
            f"tma {row.get('tma_us', float('nan')):.1f}",
            flush=True,
        )
        rows.append(row)
    return rows


def _lorafleet(name: str, hidden: int, n: int, xs) -> float:
    """kernels.lora_shrink on the same x with one adapter (one tile run of consecutive rows)."""
    layer, rank = name.split()[0], int(name.split()[1][1:])
    assert LAYERS[layer][0] == hidden and len(LAYERS[layer][1]) * rank == n
    pool = Pools(layer, rank).get(1)[0]
    meta = _one_adapter_meta(rank)
    outs = [torch.zeros(len(LAYERS[layer][1]), TOKENS, rank, device="cuda") for _ in xs]
    return time_graph(
        [
            lambda x=x, o=o: lora_shrink(x, pool.a, meta, out=o)
            for x, o in zip(xs, outs, strict=True)
        ],
        prologue=partial(_zero, outs),
    )


def _exact_tiles(tokens: int, _slots: int, block_m: int) -> int:
    return -(-tokens // block_m)


def probe_ab(bw: float) -> list[dict]:
    """qkv r16 at T=4096 (one adapter, rows consecutive): the plain GEMM with the segmented
    kernel's habits added one at a time (x rows through an index vector; a tile's K splits
    launched next to each other; rows shuffled), and kernels.lora_shrink per tile height
    and config, each beside the byte floor."""
    from dataclasses import replace

    from kernels.triton import lora_shrink as sh

    hidden, n = 4096, 48  # qkv r16: 3 x 16 rows of A
    xs, a, outs, floor_us = _gemm_inputs(hidden, n, bw)
    row_orders = (
        ("rows", None),
        ("index", torch.arange(TOKENS, dtype=torch.int32, device="cuda")),
        ("shuffled", torch.randperm(TOKENS, device="cuda").to(torch.int32)),
    )
    rows = []
    for cfg in [(False, 64, 64, 128, 3, 4)]:
        for (label, gather), split_fast in itertools.product(row_orders, (False, True)):
            us = time_graph(
                [
                    partial(gemm, x, a, o, cfg, gather, split_fast)
                    for x, o in zip(xs, outs, strict=True)
                ],
                prologue=partial(_zero, outs),
            )
            rows.append({"what": f"gemm {cfg[1:]} {label} split_fast={split_fast}", "us": us})
            print(f"{rows[-1]['what']}: {us:.1f} us (floor {floor_us:.1f})", flush=True)
    pool = Pools("qkv", 16).get(1)[0]
    for bm in (32, 64):
        meta = _one_adapter_meta(16, bm)
        base = sh.default_config(bm, 16, 2, 3, hidden)
        bufs = [torch.zeros(3, TOKENS, 16, device="cuda") for _ in xs]
        trials = [
            (base, False),
            (replace(base, stack_slices=False), False),
            (base, True),
            (replace(base, programs_per_sm=2), True),
            (replace(base, programs_per_sm=8), True),
            (replace(base, stack_slices=False), True),
        ]
        bound = sh.tile_programs
        for cfg, exact in trials:
            sh.CONFIG_OVERRIDE = cfg
            if exact:  # the grid sized by this step's tile count (T / block_m), not its bound
                sh.tile_programs = _exact_tiles
            us = time_graph(
                [
                    partial(lora_shrink, x, pool.a, meta, out=o)
                    for x, o in zip(xs, bufs, strict=True)
                ],
                prologue=partial(_zero, bufs),
            )
            sh.CONFIG_OVERRIDE = None
            sh.tile_programs = bound
            rows.append({"what": f"lora_shrink block_m={bm} exact_grid={exact} {cfg}", "us": us})
            print(f"{rows[-1]['what']}: {us:.1f} us (floor {floor_us:.1f})", flush=True)
    return rows


@triton.jit
def _empty_kernel(p):
    pass


@triton.jit
def _stream_kernel(a_ptr, out_ptr, per_program, BLOCK: tl.constexpr):
    """out[pid] = sum of a[pid * per_program : (pid + 1) * per_program] (bf16, fp32 sum)."""
    base = a_ptr + tl.program_id(0).to(tl.int64) * per_program
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, per_program, BLOCK):
        acc += tl.load(base + k + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def probe_decode(bw: float) -> list[dict]:
    """Per decode shape (T, n): the shrink, an empty kernel, and a kernel streaming the
    shrink's A bytes."""
    rows = []
    flag = torch.zeros(1, device="cuda")
    empty_us = time_graph([lambda: _empty_kernel[(1,)](flag)] * 16)
    for layer, rank, tokens, n in [
        ("qkv", 16, 256, 32),
        ("qkv", 16, 64, 8),
        ("o", 16, 64, 8),
        ("down", 16, 256, 32),
        ("gate_up", 16, 64, 32),
    ]:
        floor = floor_bytes(layer, tokens, n, rank, rank)
        pools = Pools(layer, rank)
        nsets = max(1, min(48, round(ROTATE_BYTES / floor["shrink"])))
        sets, _ = make_sets(layer, pools, tokens, n, nsets, partial(_const, rank))
        memset, outs = workspaces(sets, layer, rank)
        shrink_us = time_graph(
            [lambda st=st, o=o: call_shrink(st, out=o) for st, o in zip(sets, outs, strict=True)],
            prologue=memset,
        )
        a_bytes = int(floor["terms"]["A"])
        blobs = [torch.randn(a_bytes // 2, device="cuda").to(torch.bfloat16) for _ in range(nsets)]
        best = None
        for programs in (132, 264, 528, 1056):
            per = a_bytes // 2 // programs // 1024 * 1024
            if per == 0:
                continue
            sums = torch.empty(programs, device="cuda")
            us = time_graph(
                [partial(_stream_kernel[(programs,)], b, sums, per, BLOCK=1024) for b in blobs]
            )
            us *= a_bytes / (per * programs * 2)  # scale to the whole A
            best = us if best is None else min(best, us)
        row = {
            "shape": f"{layer} r{rank} T={tokens} n={n}",
            "shrink_us": shrink_us,
            "shrink_floor_us": floor["shrink"] / bw * 1e6,
            "empty_kernel_us": empty_us,
            "stream_A_us": best,
        }
        print(
            f"{row['shape']}: shrink {shrink_us:.1f} us | floor {row['shrink_floor_us']:.1f} | "
            f"empty kernel {empty_us:.1f} | stream A only {best:.1f}",
            flush=True,
        )
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--budget-s", type=float, default=60.0, help="config sweep seconds per shape")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--ab", action="store_true", help="the segmented kernel's habits, one by one")
    args = ap.parse_args()
    bw, result = probe_header()
    result["prefill"] = [] if args.no_prefill else probe_prefill(bw, args.budget_s)
    result["decode"] = probe_decode(bw) if args.decode else []
    result["ab"] = probe_ab(bw) if args.ab else []
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
