"""Run one shape's LoRA kernels a few times, for a profiler (GPU).

    ncu --kernel-name regex:_shrink --launch-skip 3 --launch-count 1 \
        python3 benchmarks/kernel_once.py qkv 16 4096 8

Same inputs as benchmarks/lora_kernels.py (benchmarks/lora_bench.py) (bf16, 64-slot pool, engine layouts, a zeroed
workspace for the shrink output); runs `both` (shrink then expand) `--reps` times.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lora_bench import LAYERS, Pools, call_both, make_sets, workspaces  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("layer", choices=list(LAYERS))
    ap.add_argument("rank", type=int)
    ap.add_argument("tokens", type=int)
    ap.add_argument("distinct", type=int)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    pools = Pools(args.layer, args.rank)
    sets, _ = make_sets(args.layer, pools, args.tokens, args.distinct, 1, lambda i, r=args.rank: r)
    memset, views = workspaces(sets, args.layer, args.rank)
    for _ in range(args.reps):
        memset()
        call_both(sets[0], views[0])
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
