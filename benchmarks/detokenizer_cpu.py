"""Detokenizer host time per decode step on CPU against output length: the streaming
detokenizer (replica/detokenizer.py) vs the old one that decoded every output id each
step, both timed in the same run on the same sequences.

128 sequences (the engine benchmark's batch) generate real text of the demo tokenizer
(byte-level BPE, trained here: deploy.demo.build_tokenizer); each step appends one token
to every sequence and runs `Detokenizer.update` on it, as `LLMEngine._append` does. The
figure is the median time of one step (all 128 updates) over --steps steps once the
outputs are L tokens long. Beside it: the H100 decode step of the 128 x 32-adapter engine
benchmark (benchmarks/results/logs/engine_gpu_h100_c81e25b.json, the run this result
quotes; results/engine_gpu_h100.json has the latest), which this host time adds to, since
the engine detokenizes between GPU steps.

    python benchmarks/detokenizer_cpu.py --out benchmarks/results/detokenizer_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run_info import write_results  # noqa: E402
from deploy.demo import _corpus, build_tokenizer  # noqa: E402
from replica.detokenizer import Detokenizer  # noqa: E402
from replica.sampling_params import SamplingParams  # noqa: E402
from replica.sequence import Sequence  # noqa: E402

GPU_STEP = ROOT / "benchmarks/results/logs/engine_gpu_h100_c81e25b.json"


class FullDecodeDetokenizer(Detokenizer):
    """The old update (before the streams): decode all output ids every step."""

    def _decode_new(self, seq: Sequence, end: int, final: bool) -> str:
        text = self.tokenizer.decode(seq.output_ids[:end], skip_special_tokens=True)
        if not final:
            while text.endswith("\ufffd"):  # held back: a character not complete yet
                text = text[:-1]
        return text[len(seq.text) :] if text.startswith(seq.text) else ""


def _gpu_step_ms() -> float | None:
    try:
        runs = json.loads(GPU_STEP.read_text())["results"]
    except (OSError, KeyError, ValueError):
        return None
    steps = [
        r["step_ms"] for r in runs if r.get("num_seqs") == 128 and r.get("distinct_adapters") == 32
    ]
    return statistics.median(steps) if steps else None


def measure(detok: Detokenizer, text_ids: list[int], batch: int, length: int, steps: int) -> float:
    """Median ms of one step of `batch` updates once outputs reach `length` tokens."""
    params = SamplingParams(max_tokens=length + steps, stop=("\n\n",))
    seqs = [Sequence(str(i), 1, [0], params, None, i) for i in range(batch)]
    for i, seq in enumerate(seqs):  # outputs of `length` tokens, detokenized so far
        seq.tokens += [text_ids[(i * 131 + t) % len(text_ids)] for t in range(length)]
        detok.update(seq, final=False)
    times = []
    for t in range(length, length + steps):
        start = time.perf_counter()
        for i, seq in enumerate(seqs):
            seq.tokens.append(text_ids[(i * 131 + t) % len(text_ids)])
            detok.update(seq, final=False)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as d:
        build_tokenizer(Path(d))
        tok = AutoTokenizer.from_pretrained(d)
    text_ids = tok("\n".join(_corpus())).input_ids
    load_at_start = round(os.getloadavg()[0], 2)
    gpu = _gpu_step_ms()
    print(f"batch {args.batch}; H100 decode step at 128 x 32 adapters: {gpu} ms")
    print(
        f"{'output len':>10} {'stream ms/step':>15} {'full decode ms/step':>20} {'full/stream':>12}"
    )
    rows = []
    for length in args.lengths:
        new = measure(Detokenizer(tok), text_ids, args.batch, length, args.steps)
        old = measure(FullDecodeDetokenizer(tok), text_ids, args.batch, length, args.steps)
        rows.append(
            {"output_len": length, "stream_ms_per_step": new, "full_decode_ms_per_step": old}
        )
        print(f"{length:>10} {new:>15.3f} {old:>20.3f} {old / new:>11.1f}x")
    if args.out:
        write_results(
            args,
            load_at_start,
            {
                "gpu_step_ms_h100_128x32": gpu,
                "notes": "ms_per_step: median over --steps steps of one update per sequence; "
                "full_decode: the detokenizer before the streams (every output id decoded each "
                "step), same sequences, same run",
                "results": rows,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
