"""Ops per engine decode step on CPU: a device-independent count of the kernels a step
launches (each top-level aten op is one launch or more on a GPU; a CUDA-graph replay
runs the same kernels without the host).

    python3 benchmarks/step_ops_cpu.py [--out benchmarks/results/step_ops_cpu.json]

A 32-layer tiny Llama (hidden 64), 8 sequences decoding, base model only (no adapters:
the LoRA layers' launches are `launch_probe.py`'s subject); 10 profiled decode steps
after 5 warm-up steps. Floor: none; compare trees (`git stash` / another checkout).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import engine_cpu  # noqa: E402
from replica.config import EngineConfig  # noqa: E402
from replica.engine import LLMEngine  # noqa: E402
from replica.sampling_params import SamplingParams  # noqa: E402

MODEL = dict(hidden=64, layers=32, heads=4, kv_heads=2, intermediate=128)
STEPS = 10


def ops_per_step() -> float:
    engine_cpu.MODEL = MODEL
    with tempfile.TemporaryDirectory() as d:
        model_dir, _ = engine_cpu.build(Path(d), 0, 16)
        engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", max_loras=2,
                                        max_cpu_loras=2, max_lora_rank=16, max_num_seqs=8))  # fmt: skip
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        for i in range(8):
            engine.add_request(str(i), list(range(5, 21)), params, None)
        for _ in range(5):
            engine.step()
        cpu = torch.profiler.ProfilerActivity.CPU
        with torch.profiler.profile(activities=[cpu]) as prof:
            for _ in range(STEPS):
                engine.step()
    ops = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in ops if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return len(top) / STEPS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    n = ops_per_step()
    print(f"top-level aten ops per decode step: {n:.1f} (32 layers, 8 sequences)")
    if args.out:
        doc = {"command": "python3 " + " ".join(sys.argv), "model": MODEL, "steps": STEPS,
               "ops_per_decode_step": n}  # fmt: skip
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
