"""Cold adapter load on a replica (CPU side): validate + read + pack one adapter.

    python benchmarks/adapter_load.py [--out benchmarks/results/adapter_load_cpu.json]

A Llama-3-8B-shaped rank-16 adapter on all seven projections (84 MB of bf16, written
here with random weights) goes through the replica's path (`read_adapter_files` once,
`validate_adapter_files`, `load_adapter_weights` on those bytes) and, for comparison,
the path before the eighteenth sitting (`validate_adapter_dir`: memory-mapped NaN scan
and a chunked hash, then `load_adapter_weights` reading and hashing the files again).
Floor printed beside: one read of the files plus one sha256 over them (what any
verified load must do). Median of --reps runs after one warm-up, files in the page cache.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lora_core.adapter_files import CONFIG_FILE, WEIGHTS_FILE, read_adapter_files  # noqa: E402
from lora_core.base_shape import MODULES, BaseShape  # noqa: E402
from lora_core.validate import validate_adapter_dir, validate_adapter_files  # noqa: E402
from lora_core.weights import load_adapter_weights  # noqa: E402

BASE = BaseShape("LlamaForCausalLM", 32, 4096, 32, 8, 128, 14336)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_adapter(root: Path, rank: int) -> int:
    """A PEFT directory for BASE with random bf16 weights; returns the weights' bytes."""
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(BASE.num_layers):
        for m in MODULES:
            n_in, n_out = BASE.module_shape(m)
            pre = f"base_model.model.model.layers.{layer}.{'self_attn' if m in ATTENTION else 'mlp'}.{m}"
            tensors[f"{pre}.lora_A.weight"] = (
                torch.randn(rank, n_in, generator=g) * 0.01
            ).bfloat16()
            tensors[f"{pre}.lora_B.weight"] = (
                torch.randn(n_out, rank, generator=g) * 0.01
            ).bfloat16()
    save_file(tensors, root / WEIGHTS_FILE)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": list(MODULES), "task_type": "CAUSAL_LM"}  # fmt: skip
    (root / CONFIG_FILE).write_text(json.dumps(config))
    return (root / WEIGHTS_FILE).stat().st_size


def timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        size = write_adapter(root, args.rank)

        def floor() -> None:
            hashlib.sha256((root / CONFIG_FILE).read_bytes() + (root / WEIGHTS_FILE).read_bytes())

        def before() -> None:
            m = validate_adapter_dir(root, max_rank=64, base=BASE)
            load_adapter_weights(m, BASE, torch.bfloat16)

        def now() -> None:
            files = read_adapter_files(root)
            m = validate_adapter_files(files, max_rank=64, base=BASE)
            load_adapter_weights(m, BASE, torch.bfloat16, files)

        figures = {name: timed(fn, args.reps) for name, fn in
                   (("floor_ms", floor), ("before_ms", before), ("now_ms", now))}  # fmt: skip
    print(f"adapter {size / 1e6:.1f} MB (rank {args.rank}, 7 projections x 32 layers, bf16)")
    print(f"floor (read + sha256) {figures['floor_ms']:.1f} ms | before {figures['before_ms']:.1f}"
          f" ms | now {figures['now_ms']:.1f} ms ({figures['now_ms'] / figures['floor_ms']:.2f}x"
          " the floor)")  # fmt: skip
    if args.out:
        result = {"command": "python " + " ".join(sys.argv), "machine": platform.processor()
                  or platform.machine(), "cpus": __import__("os").cpu_count(),
                  "torch": torch.__version__, "adapter_MB": size / 1e6, "rank": args.rank,
                  "reps": args.reps, **figures}  # fmt: skip
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
