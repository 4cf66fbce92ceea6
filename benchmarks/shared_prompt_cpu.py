"""n requests with one prompt arriving together (the `n` choices of one request, or a
burst sharing a system prompt): prompt tokens computed, time until every request has
its first token, and the whole run, on CPU.

    python benchmarks/shared_prompt_cpu.py [--out benchmarks/results/shared_prompt_cpu.json]

Beside each figure: the floor (one request alone: the prompt computed once) and the
cost without sharing (n requests with n different prompts of the same length, which
is what requests with one prompt cost when they arrive in the same step and each
computes it: lorafleet before the scheduler parked followers, and vLLM and SGLang,
whose prefix caches share only blocks already computed).
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

from benchmarks.engine_cpu import build  # noqa: E402
from replica.config import EngineConfig  # noqa: E402
from replica.engine import LLMEngine  # noqa: E402
from replica.sampling_params import SamplingParams  # noqa: E402


def run(model_dir: Path, ref, prompts: list[list[int]], max_tokens: int, budget: int) -> dict:
    n, longest = len(prompts), max(len(p) for p in prompts)
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device="cpu",
            max_loras=1,
            max_lora_rank=ref.rank,
            max_num_seqs=max(n, 1),
            max_num_batched_tokens=budget,
            kv_cache_tokens=n * (longest + max_tokens + 16),
        )
    )
    computed = []
    schedule = engine.scheduler.schedule

    def counting():
        out = schedule()
        computed.append(out.num_tokens)
        return out

    engine.scheduler.schedule = counting
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params, ref)
    first: dict[str, float] = {}
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            if o.new_token_ids:
                first.setdefault(o.request_id, time.perf_counter())
    end = time.perf_counter()
    decode = n * (max_tokens - 1)
    return {
        "requests": n,
        "prompt_tokens_computed": sum(computed) - decode,
        "all_first_token_s": max(first.values()) - t0,
        "wall_s": end - t0,
        "parked": engine.scheduler.num_parked,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=768)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)

    def prompt() -> list[int]:
        return torch.randint(5, 300, (args.prompt_len,), generator=g).tolist()

    shared = prompt()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, refs = build(Path(tmp), 1, 16)
        run(model_dir, refs[0], [prompt()], 2, args.budget)  # warm up
        rows = {
            "floor: one request": run(model_dir, refs[0], [shared], args.max_tokens, args.budget),
            "n choices of one prompt": run(
                model_dir, refs[0], [shared] * args.n, args.max_tokens, args.budget
            ),
            "no sharing: n prompts": run(
                model_dir, refs[0], [prompt() for _ in range(args.n)], args.max_tokens, args.budget
            ),
        }
    print(
        f"n={args.n}, prompt {args.prompt_len} tokens, {args.max_tokens} tokens each, budget {args.budget}"
    )
    print(f"{'case':<26} {'prompt tokens':>14} {'all first tok s':>16} {'wall s':>8}")
    for name, r in rows.items():
        print(
            f"{name:<26} {r['prompt_tokens_computed']:>14} {r['all_first_token_s']:>16.3f} {r['wall_s']:>8.3f}"
        )
    if args.out:
        result = {
            "command": "python " + " ".join(sys.argv),
            "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
            "model": "benchmarks/engine_cpu.py MODEL, one rank-16 adapter on all 7 projections",
            "n": args.n,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "max_num_batched_tokens": args.budget,
            "results": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
