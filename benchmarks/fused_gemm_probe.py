"""Would LoRA fused into the base GEMM beat the base GEMM + the library's shrink/expand at
decode? (GPU probe.)

The notes on the kernel misses (results/lora_kernels_h200.json, notes_on_misses.next) say
the decode misses are the expand's second launch and y's read-modify-write, and that LoRA
fused into the base GEMM would remove both. This probe measures that claim before anyone
changes shared/DESIGN.md's contract for it. Per decode step shape (Llama-3-8B layers, bf16,
rank 16, n adapters in a 64-slot pool, CUDA-graph replay, inputs rotated past L2):

  base        y = x @ W^T by torch (cuBLAS), what the engine runs
  base+lora   base, then kernels.lora_shrink_expand (one workspace memset, PDL), as the
              engine runs it
  triton      y = x @ W^T by a plain Triton GEMM, best of a few launch configs
  fused       the library's shrink into the workspace, then one Triton GEMM whose K loop
              goes on past W into the LoRA term: for each group of 4 active slots,
              h[tile rows] (zero where a row's slot is another) against those slots'
              B rows; y written once, never re-read

fused - base is what LoRA would cost fused; base+lora - base what it costs now. The
fused GEMM here computes every row against every active slot's B (dense over the
step's n adapters): wasted tensor-core work, but decode GEMMs are bound by W's bytes.

    python3 benchmarks/fused_gemm_probe.py --out benchmarks/results/fused_gemm_probe_h200.json

A probe, not a kernel of the library (benchmarks/README.md, "Probes"); ranks are all the
pool's rank here (the library masks B past a slot's rank; this probe does not).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lora_bench import (  # noqa: E402
    LAYERS,
    Pools,
    call_both,
    make_sets,
    probe_header,
    time_graph,
    workspaces,
)

from kernels import lora_shrink  # noqa: E402

SLOTS_PER_STEP = 4
"""Active slots per step of the fused GEMM's LoRA loop: 4 x rank 16 = a 64-deep dot."""


@triton.jit
def _gemm_lora_kernel(
    x_ptr, w_ptr, y_ptr, h_ptr, b_ptr, slots_ptr, act_ptr,
    M, N, K, n_act, nb1, nb2, boff1, boff2,
    stride_xm, stride_wn, stride_ym, stride_hs, stride_ht,
    R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    LORA: tl.constexpr, SPS: tl.constexpr,
):  # fmt: skip
    """y[m, n] = sum_k x[m, k] W[n, k] (+ sum_r h[s(n), m, r] B_s(n)[slot_m, n, r] if LORA).

    Program (pid_n slowest, pid_m fastest: the row tiles of one W column block run
    together, so W is read from HBM once). Columns of one program lie in one slice s
    (nb1, nb2: the slice bounds; BN divides them). B_s: rank-major [L, R, N_s] at
    b_ptr + boff_s. act: the step's active slots (n_act of them)."""
    num_m = tl.cdiv(M, BM)
    pid_m = tl.program_id(0) % num_m
    pid_n = tl.program_id(0) // num_m
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_mask = offs_m < M
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K, BK):
        xv = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        acc = tl.dot(xv, tl.load(w_ptrs), acc)
        x_ptrs += BK
        w_ptrs += BK
    if LORA:
        n0 = pid_n * BN
        s = (n0 >= nb1).to(tl.int32) + (n0 >= nb2).to(tl.int32)
        start = tl.where(s == 0, 0, tl.where(s == 1, nb1, nb2))
        width = tl.where(s == 0, nb1, tl.where(s == 1, nb2 - nb1, N - nb2)).to(tl.int64)
        boff = tl.where(s == 0, 0, tl.where(s == 1, boff1, boff2)).to(tl.int64)
        offs_r = tl.arange(0, R)
        slot_m = tl.load(slots_ptr + offs_m, mask=m_mask, other=-1)
        h_row = tl.load(
            h_ptr + s * stride_hs + offs_m[:, None] * stride_ht + offs_r[None, :],
            mask=m_mask[:, None], other=0.0,
        )  # fmt: skip
        offs_i = tl.arange(0, SPS)
        offs_j = tl.arange(0, SPS * R)
        cols = (offs_n - start).to(tl.int64)
        for i0 in range(0, n_act, SPS):
            act_i = tl.load(act_ptr + i0 + offs_i, mask=i0 + offs_i < n_act, other=-2)
            hit = slot_m[:, None] == act_i[None, :]  # [BM, SPS]
            hv = tl.where(hit[:, :, None], h_row[:, None, :], 0.0)  # [BM, SPS, R]
            hv = tl.reshape(hv, (BM, SPS * R)).to(w_ptr.dtype.element_ty)
            act_j = tl.load(act_ptr + i0 + offs_j // R, mask=i0 + offs_j // R < n_act, other=-1)
            b_rows = boff + act_j.to(tl.int64) * R * width + (offs_j % R) * width
            bv = tl.load(b_ptr + b_rows[:, None] + cols[None, :], mask=(act_j >= 0)[:, None],
                         other=0.0)  # fmt: skip
            acc = tl.dot(hv, bv, acc)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None])


def gemm_lora(x, w, y, cfg, lora=None):
    """y = x @ w^T (+ the LoRA term: lora = (h [S, T, R] fp32, b slices, token slots,
    active slots)); cfg = (BM, BN, BK, stages, warps)."""
    bm, bn, bk, stages, warps = cfg
    m, k = x.shape
    n = w.shape[0]
    if k % bk or n % bn or not (x.is_contiguous() and w.is_contiguous() and y.is_contiguous()):
        raise ValueError(f"gemm_lora: shapes {x.shape} x {w.shape} do not tile by {cfg}")
    bounds = [n, n]
    if lora is None:
        h, b, slots, act, offs, rank = y, (w,), y, y, (0, 0), 16
    else:
        h, b, slots, act = lora
        rank = b[0].shape[2]
        widths = [t.shape[1] for t in b]
        ends = [sum(widths[: i + 1]) for i in range(len(widths))]
        bounds = (ends[:-1] + [n, n])[:2]
        if any(e % bn for e in ends):
            raise ValueError(f"gemm_lora: slice bounds {ends} not multiples of BN={bn}")
        offs = [(t.data_ptr() - b[0].data_ptr()) // t.element_size() for t in b[1:]] + [0, 0]
    grid = (triton.cdiv(m, bm) * (n // bn),)
    _gemm_lora_kernel[grid](
        x, w, y, h, b[0], slots, act,
        m, n, k, act.numel() if lora else 0, bounds[0], bounds[1], offs[0], offs[1],
        x.stride(0), w.stride(0), y.stride(0), h.stride(0) if lora else 0,
        h.stride(1) if lora else 0,
        R=rank, BM=bm, BN=bn, BK=bk, LORA=lora is not None, SPS=SLOTS_PER_STEP,
        num_stages=stages, num_warps=warps,
    )  # fmt: skip
    return y


def configs(tokens: int) -> list[tuple[int, int, int, int, int]]:
    """(BM, BN, BK, stages, warps) to try: the row tile covering the step (<= 128) or half
    of it, column blocks of 32-256 (narrow ones put more programs on the 132 SMs: a
    decode GEMM of o's 4096 columns has 32 blocks of 128)."""
    bm = max(16, min(128, triton.next_power_of_2(tokens)))
    out = []
    for m in sorted({bm, max(16, bm // 2)}, reverse=True):
        out += [(m, 32, 128, 4, 4), (m, 32, 64, 6, 4), (m, 64, 128, 4, 4), (m, 128, 64, 4, 4),
                (m, 128, 128, 3, 8), (m, 256, 64, 3, 8)]  # fmt: skip
    return out


def reference(x, w, h, b, slots) -> torch.Tensor:
    """float64 y = x W^T + h_s(n)[t] B_s(n)[slot_t]^T (h rounded to W's dtype, as the
    kernels' dot inputs are)."""
    y = x.double() @ w.double().t()
    col = 0
    for s, bs in enumerate(b):
        bsel = bs[slots.long()].double()  # [T, N_s, R]
        hs = h[s].to(w.dtype).double()
        y[:, col : col + bs.shape[1]] += torch.einsum("tr,tnr->tn", hs, bsel)
        col += bs.shape[1]
    return y


def run_shape(layer: str, tokens: int, n: int, rank: int, pools) -> dict:
    hidden, sizes = LAYERS[layer]
    width = sum(sizes)
    w_bytes = width * hidden * 2
    nsets = max(1, min(16, math.ceil(180e6 / w_bytes)))
    sets, _ = make_sets(layer, pools, tokens, n, nsets, lambda i: rank, expected_slots=n)
    for st in sets:
        st["w"] = (torch.randn(width, hidden, device="cuda") * hidden**-0.5).to(torch.bfloat16)
        st["act"] = torch.unique(st["slots"]).to(torch.int32)
        st["slots32"] = st["slots"].to(torch.int32)
    memset, views = workspaces(sets, layer, rank)
    pairs = list(zip(sets, views, strict=True))

    def base(st):
        torch.mm(st["x"], st["w"].t(), out=st["y"])

    def base_lora(st, v):
        base(st)
        call_both(st, v)

    def fused(st, v, cfg):
        lora_shrink(st["x"], st["pool"].a, st["meta"], out=v)
        gemm_lora(st["x"], st["w"], st["y"], cfg, (v, st["pool"].b, st["slots32"], st["act"]))

    row = {"layer": layer, "rank": rank, "T": tokens, "n": n, "sets": nsets}
    row["base_us"] = time_graph([lambda st=st: base(st) for st in sets])
    row["base_lora_us"] = time_graph([lambda p=p: base_lora(*p) for p in pairs], prologue=memset)
    plain, fused_us = {}, {}
    for cfg in configs(tokens):
        try:
            plain[cfg] = time_graph(
                [lambda st=st, c=cfg: gemm_lora(st["x"], st["w"], st["y"], c) for st in sets]
            )
            fused_us[cfg] = time_graph(
                [lambda p=p, c=cfg: fused(*p, c) for p in pairs], prologue=memset
            )
        except Exception as e:  # an unlaunchable config is data too
            print(f"  {layer} T={tokens} n={n} {cfg}: {e!r}"[:300], flush=True)
    best_plain = min(plain, key=plain.get)
    best_fused = min(fused_us, key=fused_us.get)
    row["triton_us"], row["triton_config"] = plain[best_plain], list(best_plain)
    row["fused_us"], row["fused_config"] = fused_us[best_fused], list(best_fused)
    row["configs"] = [
        {"config": list(c), "triton_us": plain[c], "fused_us": fused_us.get(c)} for c in plain
    ]
    # correctness of the best fused config on set 0 against float64
    st, v = pairs[0]
    v.zero_()
    fused(st, v, best_fused)
    want = reference(st["x"], st["w"], v, st["pool"].b, st["slots"])
    row["fused_rel_err"] = float((st["y"].double() - want).abs().max() / want.abs().max())
    row["lora_now_us"] = row["base_lora_us"] - row["base_us"]
    row["lora_fused_us"] = row["fused_us"] - row["base_us"]
    del sets, pairs, views
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--layers", default="qkv,o,gate_up,down")
    ap.add_argument("--tokens", default="32,128")
    ap.add_argument("--adapters", default="8,32")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--budget-s", type=float, default=300)
    args = ap.parse_args()
    torch.manual_seed(0)
    bw, doc = probe_header()
    doc["rows"] = []
    t0 = time.monotonic()
    print("layer    T   n | base  base+lora (lora) | triton | fused (lora) | err", flush=True)
    for layer in args.layers.split(","):
        pools = Pools(layer, args.rank)
        for tokens in (int(t) for t in args.tokens.split(",")):
            for n in (int(a) for a in args.adapters.split(",")):
                if time.monotonic() - t0 > args.budget_s:
                    print(f"budget spent: skipping {layer} T={tokens} n={n}", flush=True)
                    continue
                r = run_shape(layer, tokens, n, args.rank, pools)
                doc["rows"].append(r)
                print(f"{layer:7s} {tokens:4d} {n:3d} | {r['base_us']:6.1f} {r['base_lora_us']:6.1f} "
                      f"({r['lora_now_us']:5.1f}) | {r['triton_us']:6.1f} | {r['fused_us']:6.1f} "
                      f"({r['lora_fused_us']:5.1f}) | {r['fused_rel_err']:.1e}", flush=True)  # fmt: skip
                if args.out:
                    args.out.write_text(json.dumps(doc, indent=1))
        del pools
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
