"""Per-step cost of the engine's sampler on the GPU: the batched sampler against the
per-row loop it replaced, at a Llama-3 vocabulary (128256) and 32 / 128 rows; then the
cost of logit_bias and the penalties on half of 128 rows (against the same rows with none).

    python3 benchmarks/sampler_gpu.py [--out benchmarks/results/sampler_h200.json]

Floor: reading the logits once (n x V float32) at the copy bandwidth measured in the
same run. Each figure is the median wall time of one `sample` call (it ends in its one
host sync, as in the engine's step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replica.logits_processors import TokenHistory  # noqa: E402
from replica.sampler import SeedStream, sample  # noqa: E402
from replica.sampling_params import SamplingParams  # noqa: E402

VOCAB = 128256
MODES = {
    "greedy": dict(temperature=0.0),
    "temperature 0.8": dict(temperature=0.8),
    "top_p 0.95": dict(temperature=0.8, top_p=0.95),
    "top_k 50 + top_p 0.9": dict(temperature=0.8, top_k=50, top_p=0.9),
    "temperature 0.8, seeded": dict(temperature=0.8, seed=1),
}


def per_row_baseline(logits, params, generators) -> list[int]:
    """The sampler before (2026-12-04): a loop over rows, one multinomial and one host
    sync per non-greedy row (logprobs left out: neither version computes them here)."""
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k and p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            drop = probs.cumsum(-1) - probs >= p.top_p
            row = torch.empty_like(row).scatter_(0, order, sorted_logits.masked_fill(drop, -1e30))
        probs = torch.softmax(row, dim=-1)
        tokens[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return tokens


PENALTY_ROWS = 128
PROMPT_LEN, OUTPUT_LEN = 1024, 256
"""Each penalised row's history: a 1k-token prompt and 256 generated tokens."""
PENALISED = SamplingParams(
    temperature=0.0,
    repetition_penalty=1.1,
    presence_penalty=0.5,
    frequency_penalty=0.5,
    logit_bias=tuple((t, 5.0) for t in range(0, 1000, 100)),
)


class History:
    def __init__(self, tokens: list[int], prompt_len: int):
        self.tokens, self.prompt_len = tokens, prompt_len
        self.prompt_array = np.asarray(tokens[:prompt_len], dtype=np.int64)
        self.output_array = np.asarray(tokens[prompt_len:], dtype=np.int64)  # kept by the engine


def histories(n: int) -> list[TokenHistory]:
    g = torch.Generator().manual_seed(0)
    return [
        History(torch.randint(VOCAB, (PROMPT_LEN + OUTPUT_LEN,), generator=g).tolist(), PROMPT_LEN)
        for _ in range(n)
    ]


def penalty_case(bw: float) -> dict:
    """Greedy at PENALTY_ROWS rows: none penalised, then every other row penalised."""
    n = PENALTY_ROWS
    logits = torch.randn(n, VOCAB, device="cuda") * 3
    hist = histories(n)
    plain = [SamplingParams(temperature=0.0)] * n
    half = [PENALISED if i % 2 else plain[i] for i in range(n)]
    none_ms = timed(lambda: sample(logits, plain, [None] * n, None, hist))
    half_ms = timed(lambda: sample(logits, half, [None] * n, None, hist))
    floor_ms = n * VOCAB * 4 / bw * 1e3
    print(
        f"\n{n} rows greedy, penalties + logit_bias on half (history {PROMPT_LEN} + "
        f"{OUTPUT_LEN} tokens): floor {floor_ms:.3f} ms, none {none_ms:.3f} ms, "
        f"half {half_ms:.3f} ms, extra {half_ms - none_ms:.3f} ms"
    )
    return dict(rows=n, prompt_len=PROMPT_LEN, output_len=OUTPUT_LEN, floor_ms=floor_ms,
                none_ms=none_ms, half_penalised_ms=half_ms)  # fmt: skip


def timed(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def copy_bandwidth() -> float:
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = timed(lambda: (y.copy_(x), torch.cuda.synchronize()), 20)
    return 2 * x.numel() / (ms * 1e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="32,128")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    rows_out = []
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; vocab {VOCAB}")
    print(
        f"{'rows':>5} {'mode':<26} {'floor ms':>9} {'per-row ms':>11} {'batched ms':>11} {'speedup':>8}"
    )
    for n in [int(r) for r in args.rows.split(",")]:
        logits = torch.randn(n, VOCAB, device="cuda") * 3
        floor_ms = n * VOCAB * 4 / bw * 1e3
        for mode, kw in MODES.items():
            params = [SamplingParams(**kw)] * n
            # the per-row loop drew from a torch.Generator per row; the engine now draws
            # from a SeedStream per row
            gens = [
                torch.Generator(device="cuda").manual_seed(i) if "seed" in kw else None
                for i in range(n)
            ]
            streams = [SeedStream(i) if "seed" in kw else None for i in range(n)]
            old = timed(lambda lg=logits, ps=params, gs=gens: per_row_baseline(lg, ps, gs))
            new = timed(lambda lg=logits, ps=params, ss=streams: sample(lg, ps, ss))
            row = dict(rows=n, mode=mode, floor_ms=floor_ms, per_row_ms=old, batched_ms=new,
                       speedup=old / new)  # fmt: skip
            rows_out.append(row)
            print(
                f"{n:>5} {mode:<26} {floor_ms:>9.3f} {old:>11.3f} {new:>11.3f} {old / new:>7.1f}x"
            )
    penalties = penalty_case(bw)
    if args.out:
        result = {
            "command": "python3 " + " ".join(sys.argv),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "copy_bw_TBps": bw / 1e12,
            "vocab": VOCAB,
            "rows": rows_out,
            "penalties": penalties,
        }
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
