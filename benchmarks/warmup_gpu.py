"""What EngineConfig.kernel_warmup costs at start and what it saves while serving, on a
random-weight Llama-3-8B-shaped model in bf16 with rank-16 adapter slots.

    python3 benchmarks/warmup_gpu.py [--out benchmarks/results/warmup_h100.json]
    python3 benchmarks/warmup_gpu.py --smoke      # tiny shapes on the CPU

Builds the engine's decode and mixed-step graph objects as `replica.engine_setup` does
(max_num_seqs, max_loras, max_num_batched_tokens as given) and times
`warm_graph_keys` three ways:
- cold: an empty TRITON_CACHE_DIR, so every kernel variant compiles (a fresh node);
- disk: again with Triton's in-memory caches dropped, so every variant loads from the
  disk cache (a restart on the same node);
- in memory: everything already loaded: the eager forwards alone (the warm-up's floor).
Beside them, the stall it removes: the first capture of the 64-token mixed-step bucket
with adapters, after warm-up and, on a fresh empty cache, without it. Each figure is one
run (start-up is a one-off).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import engine_gpu  # noqa: E402
from benchmarks.engine_shapes import LLAMA3_8B, SMOKE  # noqa: E402
from kernels.testing import compiled_binaries, jit_kernels  # noqa: E402
from replica.cuda_graphs import DecodeGraphs  # noqa: E402
from replica.engine_setup import warm_graph_keys  # noqa: E402
from replica.mixed_graphs import MixedGraphs  # noqa: E402
from replica.models.config import ModelConfig  # noqa: E402

BLOCK = 16


def drop_triton_memory_caches() -> int:
    """Forget every compiled binary kernels.triton's JIT kernels (and their FastLaunch
    wrappers) hold in memory, so the next launch of each looks in the disk cache. ->
    binaries dropped."""
    from kernels.triton.launch import FastLaunch

    dropped = compiled_binaries()
    for k in jit_kernels():
        if isinstance(k, FastLaunch):
            k.kept.clear()
        else:
            k.device_caches.clear()
    return dropped


def graph_objects(model, ctx, cfg, args, device, capture: bool):
    """The engine's decode and mixed-step graph objects (`replica.engine_setup._graphs`)
    over a small KV cache (warm-up writes only its scratch block)."""
    blocks = 8
    shape = (blocks + 1, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    kv = [
        (torch.zeros(shape, dtype=torch.bfloat16, device=device),
         torch.zeros(shape, dtype=torch.bfloat16, device=device))
        for _ in range(cfg.num_layers)
    ]  # fmt: skip
    decode = DecodeGraphs(model, kv, BLOCK, ctx, blocks, args.max_num_seqs, 64)
    mixed = MixedGraphs(model, kv, ctx, args.max_num_batched_tokens, capture=capture)
    return decode, mixed


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started


def cold_cache() -> None:
    """An empty Triton disk cache from now on (Triton reads TRITON_CACHE_DIR at each
    compile), nothing in memory."""
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="warmup_gpu_")
    drop_triton_memory_caches()


def run(args) -> dict:
    device = torch.device("cpu" if args.smoke else "cuda")
    engine_gpu.DEVICE = device
    hf = {**LLAMA3_8B, "num_hidden_layers": args.layers, **(SMOKE if args.smoke else {})}
    cfg = ModelConfig.from_hf(hf)
    model, ctx, _ = engine_gpu.build(cfg, args.max_loras, args.rank)
    capture = not args.smoke
    cold_cache()
    decode, mixed = graph_objects(model, ctx, cfg, args, device, capture)
    stall_key = mixed.key_for(64, 1)
    cold = timed(lambda: warm_graph_keys(decode, mixed, device))
    warm_capture = timed(lambda: mixed._capture(stall_key))
    dropped = drop_triton_memory_caches()
    disk = timed(lambda: warm_graph_keys(decode, mixed, device))
    eager = timed(lambda: warm_graph_keys(decode, mixed, device))
    cold_cache()  # the same capture without warm-up, as a fresh node's first such step
    _, fresh = graph_objects(model, ctx, cfg, args, device, capture)
    cold_capture = timed(lambda: fresh._capture(stall_key))
    row = {
        "keys": len(decode.compile_keys()) + len(mixed.compile_keys()),
        "decode_keys": len(decode.compile_keys()),
        "mixed_keys": len(mixed.compile_keys()),
        "binaries": dropped,
        "cold_cache_s": round(cold, 3),
        "disk_cache_s": round(disk, 3),
        "in_memory_s": round(eager, 3),
        "first_capture_after_warmup_s": round(warm_capture, 3),
        "first_capture_cold_cache_s": round(cold_capture, 3),
    }
    print(
        f"kernel_warmup over {row['keys']} keys ({row['decode_keys']} decode, "
        f"{row['mixed_keys']} mixed; {dropped} binaries): cold cache {cold:.1f} s, disk cache "
        f"{disk:.1f} s, in memory {eager:.1f} s (the floor: the eager forwards alone)\n"
        f"the stall it removes: the first capture of the 64-token LoRA bucket takes "
        f"{cold_capture:.2f} s on a cold cache without warm-up, {warm_capture:.2f} s after it"
    )
    return {
        "command": "python3 " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "row": row,
    }


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-loras", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, no capture")
    ap.add_argument("--out", type=Path)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    doc = run(args)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
