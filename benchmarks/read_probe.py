"""What streaming x [T, H] bf16 costs in the prefill shrink's tile structure (GPU probe).

The prefill shrink reads x in [BM, BK] tiles, K split over programs, ~4 programs per SM,
and runs at 1.5-3x x's byte floor, as a plain split-K Triton GEMM of the same shape
does (results/shrink_probe_h200.json). This probe separates the read from the GEMM:
  read  each program sums its [BM, K / split] block of x row-wise (no dot, no A):
        the tile structure alone
  dot   the same loop with a dot against a [BK, N] operand (N = 16 or 64, from L2),
        the shrink's arithmetic without its gather or metadata
against torch's x.sum(1) (one streaming pass), a copy of x (twice the bytes), and the
byte floor at the copy bandwidth measured in the same run (a long copy), at several T:
how much of a short kernel's distance from that floor is fixed cost. CUDA-graph
replay, inputs rotated past L2.

    python3 benchmarks/read_probe.py --tokens 1024,4096,16384 --out benchmarks/results/read_probe_h200.json

A probe, not a kernel of the library (benchmarks/README.md, "Probes").
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lora_bench import probe_header, time_graph  # noqa: E402


@triton.jit
def _read_kernel(x_ptr, a_ptr, out_ptr, k_per_split, stride_xt,
                 BM: tl.constexpr, BK: tl.constexpr, N: tl.constexpr, DOT: tl.constexpr,
                 STAGES: tl.constexpr):  # fmt: skip
    """Semantics: out[rows, :] += sum over this program's K range of x[rows, k] (* a[k, :])."""
    k0 = tl.program_id(0) * k_per_split
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    offs_n = tl.arange(0, N)
    x_ptrs = x_ptr + rows[:, None] * stride_xt + (k0 + offs_k)[None, :]
    if DOT:
        acc = tl.zeros((BM, N), dtype=tl.float32)
    else:
        acc = tl.zeros((BM,), dtype=tl.float32)
    for i in tl.range(0, k_per_split // BK, num_stages=STAGES):
        xv = tl.load(x_ptrs + i * BK)
        if DOT:
            av = tl.load(a_ptr + (k0 + i * BK + offs_k)[:, None] * N + offs_n[None, :])
            acc = tl.dot(xv, av, acc)
        else:
            acc += tl.sum(xv.to(tl.float32), 1)
    if DOT:
        tl.atomic_add(out_ptr + rows[:, None] * N + offs_n[None, :], acc, sem="relaxed")
    else:
        tl.atomic_add(out_ptr + rows * N, acc, sem="relaxed")


def _read(x, a, out, bm, bk, split, stages, warps, dot):
    tokens, hidden = x.shape
    _read_kernel[(split, tokens // bm)](
        x, a, out, hidden // split, x.stride(0),
        BM=bm, BK=bk, N=a.shape[1], DOT=dot, STAGES=stages, num_warps=warps,
    )  # fmt: skip


CONFIGS = [  # bm, bk, split, stages, warps
    (32, 128, 4, 3, 4),
    (64, 128, 4, 3, 4),
    (64, 128, 2, 3, 4),
    (64, 128, 8, 3, 4),
    (16, 128, 2, 3, 4),
    (16, 256, 2, 3, 4),
    (32, 256, 4, 3, 4),
    (64, 256, 4, 2, 8),
    (64, 64, 4, 6, 4),
    (128, 64, 4, 4, 8),
    (32, 512, 4, 2, 4),
    (8, 512, 1, 3, 4),
]


def probe(bw: float, tokens: int, hidden: int, read_only: bool = False) -> list[dict]:
    sets = max(2, int(200e6 // (tokens * hidden * 2)) + 1)  # past the 50 MB L2
    xs = [torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    rows = []
    floor = tokens * hidden * 2 / bw * 1e6
    torch_us = time_graph([partial(torch.sum, x, 1) for x in xs], 10)
    dst = torch.empty_like(xs[0])
    copy_us = time_graph([partial(dst.copy_, x) for x in xs], 10)
    print(f"T={tokens} H={hidden}: floor {floor:.1f} us, torch x.sum(1) {torch_us:.1f} us, "
          f"copy of x {copy_us:.1f} us (floor {2 * floor:.1f})")  # fmt: skip
    trials = [(16, False)] if read_only else [(16, False), (16, True), (64, True)]  # (n, dot)
    for n, dot in trials:
        a = torch.randn(hidden, n, device="cuda", dtype=torch.bfloat16)
        outs = [torch.zeros(tokens, n, device="cuda") for _ in xs]
        for cfg in CONFIGS:
            fns = [partial(_read, x, a, o, *cfg, dot) for x, o in zip(xs, outs, strict=True)]
            try:
                us = time_graph(fns, 10)
            except Exception as err:  # noqa: BLE001 - past shared memory: data too
                print(f"  {cfg} dot={dot} n={n}: {type(err).__name__}", flush=True)
                continue
            if dot:  # the dot's result against torch, once per config
                o = outs[0].zero_()
                _read(xs[0], a, o, *cfg, True)
                want = xs[0].float() @ a.float()
                err = ((o - want).abs().max() / want.abs().max()).item()
                assert err < 1e-2, (cfg, err)
            rows.append({"T": tokens, "H": hidden, "n": n, "config": list(cfg), "dot": dot,
                         "us": us, "floor_us": floor, "torch_sum_us": torch_us,
                         "torch_copy_us": copy_us})  # fmt: skip
            print(f"  bm,bk,split,stages,warps={cfg} {'dot n=' + str(n) if dot else 'read':9s}"
                  f" {us:6.1f} us  x{us / floor:.2f} floor", flush=True)  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tokens", default="4096", help="comma-separated T (rows of x)")
    ap.add_argument("--read-only", action="store_true", help="no dot configs")
    args = ap.parse_args()
    bw, result = probe_header()
    result["rows"] = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        result["rows"] += probe(bw, tokens, 4096, args.read_only)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
