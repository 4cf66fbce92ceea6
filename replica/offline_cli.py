"""`lorafleet generate`: offline batch inference through one engine.

Every input line goes through the same engine in shared mixed batches; outputs are
written in input order. Bad input exits 1 with a one-line message.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lora_core.errors import LoraFleetError
from replica.config import DTYPES

# Fields a JSONL line may carry; "id", "metadata" and keys starting with "_" are
# passed through to the output untouched.
SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
)
LINE_FIELDS = frozenset(("prompt", "adapter", "id", "metadata", *SAMPLING_FIELDS))


def register_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="offline generation over a JSONL file")
    p.add_argument("--model", required=True, help="HF model directory or cached hub id")
    p.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a PEFT LoRA adapter (repeatable)",
    )
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--max-cpu-loras", type=int, default=8)
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--input", required=True, type=Path, help="JSONL: {prompt, adapter, ...sampling fields}"
    )
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from replica.offline import OfflineJob, parse_adapter_args  # lazy: torch is slow to import

    try:
        adapters = parse_adapter_args(args.adapter)
        lines = _read_lines(args.input)
        job = OfflineJob.from_args(args, adapters)
        results = job.run(lines, progress=not args.quiet)
    except (LoraFleetError, ValueError, OSError) as e:
        print(f"lorafleet generate: {e}", file=sys.stderr)
        return 1
    with args.output.open("w") as f:
        for row in results:
            f.write(json.dumps(row) + "\n")
    return 0


def _read_lines(path: Path) -> list[dict]:
    rows = []
    with path.open() as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from e
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f'{path}:{i}: each line must be an object with a string "prompt"')
            unknown = sorted(k for k in row if k not in LINE_FIELDS and not k.startswith("_"))
            if unknown:
                raise ValueError(
                    f"{path}:{i}: unknown field(s) {unknown}; allowed: {', '.join(sorted(LINE_FIELDS))}"
                )
            rows.append(row)
    return rows
