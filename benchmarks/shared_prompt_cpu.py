"""Shared prompts on CPU: prompt tokens computed, time to every first token, whole run.

Two cases arrive together: n requests with one prompt (the `n` choices of one request),
and n requests that share a system prompt and differ in their last --own tokens.

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
import statistics
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
        "prompt_tokens_computed": engine.stats().computed_tokens - decode,
        "all_first_token_s": max(first.values()) - t0,
        "wall_s": end - t0,
        "parked": engine.scheduler.num_parked,
    }


def summary(runs: list[dict]) -> dict:
    """One case's rounds -> the median times (and each round's), and the prompt tokens
    computed (the same every round: scheduling does not depend on timing)."""
    computed = {r["prompt_tokens_computed"] for r in runs}
    assert len(computed) == 1, f"prompt tokens computed differ between rounds: {computed}"
    out = dict(runs[-1])
    for key in ("all_first_token_s", "wall_s"):
        out[key] = statistics.median(r[key] for r in runs)
        out[key + "_per_round"] = [round(r[key], 4) for r in runs]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=768)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument(
        "--own", type=int, default=64, help="tokens of each prompt after the shared system prompt"
    )
    ap.add_argument("--repeat", type=int, default=5, help="rounds; times are medians")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)

    def prompt() -> list[int]:
        return torch.randint(5, 300, (args.prompt_len,), generator=g).tolist()

    shared = prompt()
    cases = {
        "floor: one request": [shared],
        "n choices of one prompt": [shared] * args.n,
        "n prompts, one system prompt": [
            shared[: -args.own] + prompt()[: args.own] for _ in range(args.n)
        ],
        "no sharing: n prompts": [prompt() for _ in range(args.n)],
    }
    runs: dict[str, list[dict]] = {name: [] for name in cases}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, refs = build(Path(tmp), 1, 16)
        run(model_dir, refs[0], [prompt()], 2, args.budget)  # warm up
        for _ in range(args.repeat):  # rounds over all cases: drift hits each alike
            for name, prompts in cases.items():
                runs[name].append(run(model_dir, refs[0], prompts, args.max_tokens, args.budget))
    rows = {name: summary(r) for name, r in runs.items()}
    print(
        f"n={args.n}, prompt {args.prompt_len} tokens, {args.max_tokens} tokens each, budget {args.budget}"
    )
    print(f"{'case':<28} {'prompt tokens':>14} {'all first tok s':>16} {'wall s':>8}")
    for name, r in rows.items():
        print(
            f"{name:<28} {r['prompt_tokens_computed']:>14} {r['all_first_token_s']:>16.3f} {r['wall_s']:>8.3f}"
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
            "own_tokens_after_system_prompt": args.own,
            "rounds": args.repeat,
            "results": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
