"""Engine throughput on CPU: base-only vs 4 and 16 distinct adapters on a tiny model.

    python benchmarks/engine_cpu.py [--out benchmarks/results/engine_cpu.json]

Floor: the base-only run of the same batch on the same engine (LoRA overhead = the
ratio to it). Every request decodes exactly --max-tokens tokens (ignore_eos).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.demo import build_model, build_tokenizer, write_peft_adapter  # noqa: E402
from replica.config import EngineConfig  # noqa: E402
from replica.engine import LLMEngine  # noqa: E402
from replica.offline import adapter_ref  # noqa: E402
from replica.sampling_params import SamplingParams  # noqa: E402

MODEL = dict(hidden=256, layers=4, heads=8, kv_heads=4, intermediate=768)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build(root: Path, num_adapters: int, rank: int):
    model_dir = root / "model"
    build_tokenizer(model_dir)
    build_model(model_dir, **MODEL)
    h, i, hd = MODEL["hidden"], MODEL["intermediate"], MODEL["hidden"] // MODEL["heads"]
    kv = MODEL["kv_heads"] * hd
    shapes = {
        "q_proj": (h, h),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (h, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }
    adapters = []
    for n in range(num_adapters):
        path = root / f"adapter{n}"
        write_peft_adapter(
            path,
            num_layers=MODEL["layers"],
            shapes=shapes,
            rank=rank,
            alpha=rank,
            seed=n,
            base_model="bench",
        )
        adapters.append(adapter_ref(f"a{n}", path, max_rank=rank))
    return model_dir, adapters


def run(
    model_dir: Path, refs, num_seqs: int, prompt_len: int, max_tokens: int, max_loras: int
) -> dict:
    cfg = EngineConfig(
        model=str(model_dir),
        device="cpu",
        max_loras=max_loras,
        max_cpu_loras=max(max_loras, 16),
        max_lora_rank=max((r.rank for r in refs), default=16),
        max_num_seqs=num_seqs,
        max_num_batched_tokens=4096,
        kv_cache_tokens=num_seqs * (prompt_len + max_tokens + 16),
    )
    engine = LLMEngine(cfg)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for i in range(num_seqs):
        prompt = torch.randint(5, 300, (prompt_len,), generator=g).tolist()
        engine.add_request(str(i), prompt, params, refs[i % len(refs)] if refs else None)
    t0 = time.perf_counter()
    generated, first_decode_t, decode_tokens = 0, None, 0
    while engine.has_unfinished():
        outs = engine.step()
        n = sum(len(o.new_token_ids) for o in outs)
        generated += n
        if first_decode_t is None and n:
            first_decode_t = time.perf_counter()
        elif first_decode_t is not None:
            decode_tokens += n
    end = time.perf_counter()
    return {
        "tokens_per_s": generated / (end - t0),
        "decode_tokens_per_s": decode_tokens / (end - first_decode_t),
        "generated": generated,
        "wall_s": end - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, refs = build(Path(tmp), 16, args.rank)
        for n in (0, 4, 16):
            r = run(
                model_dir,
                refs[:n],
                args.num_seqs,
                args.prompt_len,
                args.max_tokens,
                max_loras=max(n, 1),
            )
            rows.append({"distinct_adapters": n, **r})
    base = rows[0]["decode_tokens_per_s"]
    print(f"{'adapters':>8} {'tok/s':>9} {'decode tok/s':>13} {'vs base (floor)':>16}")
    for r in rows:
        r["ratio_to_base"] = r["decode_tokens_per_s"] / base
        print(
            f"{r['distinct_adapters']:>8} {r['tokens_per_s']:>9.1f} {r['decode_tokens_per_s']:>13.1f} {r['ratio_to_base']:>15.2f}x"
        )
    if args.out:
        result = {
            "command": "python " + " ".join(sys.argv),
            "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} threads, torch {torch.__version__}",
            "model": MODEL,
            "rank": args.rank,
            "num_seqs": args.num_seqs,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "kernels": "torch reference (CPU)",
            "results": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
