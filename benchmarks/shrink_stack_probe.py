"""Rank-64 prefill shrinks (GPU probe): stream-K against the fused split-K grid with the
slices' A rows stacked into one operand (ShrinkConfig.stack_slices; gate_up: 2 x 64 =
128 rows; qkv: 3 x 64 = 192 rows in a 256-row operand, or with --tail q and k stacked
into 128 rows and v its own dot, ShrinkConfig.stack_tail), the shrink alone, CUDA-graph
replay, inputs rotated past L2, each config's output against stream-K's.

    python3 benchmarks/shrink_stack_probe.py --out benchmarks/results/shrink_stack_h200.json
    python3 benchmarks/shrink_stack_probe.py --tail --out benchmarks/results/shrink_tail_h200.json

A probe, not a kernel of the library (benchmarks/README.md, "Probes").
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lora_bench import (  # noqa: E402
    LAYERS,
    Pools,
    call_shrink,
    floor_bytes,
    make_sets,
    num_sets,
    probe_header,
    time_config,
    workspaces,
)

from kernels.triton import lora_shrink as sh  # noqa: E402
from kernels.triton.shrink_plan import ShrinkConfig, stream_config  # noqa: E402

SHAPES = [  # layer, T, n (rank 64)
    ("gate_up", 4096, 1), ("gate_up", 4096, 8), ("gate_up", 4096, 32), ("gate_up", 4096, 64),
    ("gate_up", 2048, 8), ("gate_up", 1024, 1), ("gate_up", 1024, 8), ("gate_up", 1024, 32),
    ("qkv", 4096, 1), ("qkv", 4096, 8), ("qkv", 2048, 32), ("qkv", 1024, 32),
]  # fmt: skip
TAIL_SHAPES = [  # the qkv shapes (--tail; gate_up has no tail: a control)
    ("qkv", 4096, 1), ("qkv", 4096, 8), ("qkv", 4096, 32), ("qkv", 4096, 64),
    ("qkv", 2048, 8), ("qkv", 2048, 32), ("qkv", 1024, 1), ("qkv", 1024, 32),
    ("gate_up", 4096, 8),
]  # fmt: skip
STACKED = [  # block_k, stages, warps of ShrinkConfig(block_k, 4, fuse_slices=True, ...)
    (64, 3, 4),
    (64, 3, 8),
    (64, 2, 8),
    (32, 4, 8),
]


def probe(bw: float, tail: bool = False) -> list[dict]:
    rows = []
    for layer, tokens, n in TAIL_SHAPES if tail else SHAPES:
        rank = 64
        fb = floor_bytes(layer, tokens, n, rank, rank)
        pools = Pools(layer, rank)
        sets, _ = make_sets(layer, pools, tokens, n, num_sets(fb), lambda i, r=rank: r)
        memset, views = workspaces(sets, layer, rank)
        fns = [functools.partial(call_shrink, st, v) for st, v in zip(sets, views, strict=True)]
        bm = sets[0]["meta"].block_m
        configs = [stream_config(bm, rank, 2, LAYERS[layer][0])]
        configs += [ShrinkConfig(bk, 4, True, st, w, stack_tail=tail) for bk, st, w in STACKED]
        want = None
        for cfg in configs:
            us = time_config(sh, "CONFIG_OVERRIDE", cfg, fns, memset)
            out = torch.zeros_like(views[0])
            sh.CONFIG_OVERRIDE = cfg
            try:
                call_shrink(sets[0], out)
            finally:
                sh.CONFIG_OVERRIDE = None
            want = out if want is None else want
            err = ((out - want).abs().max() / want.abs().max()).item()
            assert err < 1e-3, (layer, tokens, n, cfg, err)
            row = {"shape": f"{layer} r{rank} T={tokens} n={n}", "block_m": bm,
                   "config": repr(cfg), "us": us, "floor_us": fb["shrink"] / bw * 1e6,
                   "err_vs_stream_k": err}  # fmt: skip
            rows.append(row)
            print(f"{row['shape']:24s} {us:7.1f} us (floor {row['floor_us']:.1f}) "
                  f"{'stream-K' if cfg.stream_k else 'stacked'} {cfg}", flush=True)  # fmt: skip
        del sets, views, pools
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tail", action="store_true", help="qkv: q and k stacked, v its own dot")
    args = ap.parse_args()
    bw, result = probe_header()
    result["rows"] = probe(bw, args.tail)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
