"""`lorafleet generate`: offline batch inference through one engine.

Every input line goes through the same engine in shared mixed batches; outputs are
written in input order. Bad input exits 1 with a one-line message naming the line, before
the model loads where it can; the output file appears only once every line was accepted and
ran (a line that failed while generating, e.g. on NaN logits, is a row with finish_reason
"error" and an `error` key).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lora_core.errors import LoraFleetError
from replica.config import DENSE_PROMPT_MIN, DTYPES
from replica.logit_bias import MAX_BIAS
from replica.sampling_checks import (
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TOP_LOGPROBS,
    SHORT,
    is_int,
    is_number,
)


def _is_str_list(x: object) -> bool:
    return isinstance(x, list) and all(isinstance(s, str) for s in x)


def _is_int_list(x: object) -> bool:
    return isinstance(x, list) and all(is_int(t) for t in x)


def _is_bias_object(x: object) -> bool:
    """OpenAI's logit_bias shape (which keys are token ids SamplingParams' rule decides)."""
    return isinstance(x, dict) and all(is_number(b) for b in x.values())


def _penalty(name: str) -> str:
    return f"a number -{MAX_PENALTY:g} <= {name} <= {MAX_PENALTY:g} (0 = off)"


# The JSON type each field must have (ranges are SamplingParams' and the engine's to check):
# field -> (check, what is allowed). "id", "metadata" and keys starting with "_" are
# passed through to the output untouched.
FIELD_TYPES: dict[str, tuple[Callable[[object], bool], str]] = {
    "prompt": (lambda x: isinstance(x, str) or _is_int_list(x), "a string or a list of token ids"),
    "adapter": (lambda x: x is None or isinstance(x, str), "null or an adapter name"),
    "max_tokens": (is_int, "an integer >= 1, or 0 (the prompt only)"),
    "temperature": (is_number, "a number 0 <= temperature <= 2"),
    "top_p": (is_number, "a number 0 < top_p <= 1"),
    "top_k": (is_int, "an integer >= 0 (0 = off), or -1 (off, as in vLLM)"),
    "seed": (lambda x: x is None or is_int(x), "null or an integer"),
    "stop": (lambda x: isinstance(x, str) or _is_str_list(x), "a string or a list of strings"),
    "stop_token_ids": (_is_int_list, "a list of token ids"),
    "ignore_eos": (lambda x: isinstance(x, bool), "true or false"),
    "min_tokens": (is_int, "an integer 0 <= min_tokens <= max_tokens"),
    "logprobs": (lambda x: isinstance(x, bool), "true or false"),
    "top_logprobs": (
        is_int,
        f"an integer 0 <= top_logprobs <= {MAX_TOP_LOGPROBS} (needs logprobs)",
    ),
    "prompt_logprobs": (
        is_int,
        f"null or an integer 0 <= prompt_logprobs <= {MAX_TOP_LOGPROBS}",
    ),
    "presence_penalty": (is_number, _penalty("presence_penalty")),
    "frequency_penalty": (is_number, _penalty("frequency_penalty")),
    "repetition_penalty": (
        is_number,
        f"a number 0 < repetition_penalty <= {MAX_REPETITION_PENALTY:g} (1 = off)",
    ),
    "min_p": (is_number, "a number 0 <= min_p <= 1 (0 = off)"),
    "allowed_token_ids": (_is_int_list, "a non-empty list of token ids"),
    "logit_bias": (
        _is_bias_object,
        f"an object of token ids as decimal strings to numbers -{MAX_BIAS:g}..{MAX_BIAS:g} "
        '({"50256": -100})',
    ),
    "include_stop_str_in_output": (lambda x: isinstance(x, bool), "true or false"),
    "skip_special_tokens": (lambda x: isinstance(x, bool), "true or false"),
    "truncate_prompt_tokens": (
        is_int,
        "null, an integer >= 1 (keep the prompt's last k tokens) or -1 (the context length)",
    ),
    "structured_outputs": (
        lambda x: isinstance(x, dict),
        'an object, vLLM\'s structured_outputs: {"json": schema}, {"regex": "..."}, '
        '{"choice": [...]}, {"grammar": "..."} or {"json_object": true}, '
        '"disable_any_whitespace": false for free (bounded) whitespace in JSON',
    ),
}
SAMPLING_FIELDS = tuple(k for k in FIELD_TYPES if k not in ("prompt", "adapter"))
# As in OpenAI and vLLM bodies, `"field": null` is "not given" (the --flag or built-in
# default); seed and adapter give null its own meaning (unseeded, the base model).
NULL_IS_DEFAULT = frozenset(SAMPLING_FIELDS) - {"seed"}
LINE_FIELDS = frozenset(("id", "metadata", *FIELD_TYPES))
# Output keys holding results; a request's own `logprobs` / `top_logprobs` /
# `prompt_logprobs` are not echoed.
ASKING_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs")
RESULT_FIELDS = ("token_ids", "text", "finish_reason", *ASKING_FIELDS, "prompt_top_logprobs")


@dataclass(frozen=True)
class InputLine:
    """One JSONL request. number: its 1-based line in the input file (for errors)."""

    number: int
    fields: dict


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
    p.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="weights dtype (default %(default)s)"
    )
    p.add_argument(
        "--device", default="auto", help="cpu, cuda, cuda:N or auto (default %(default)s)"
    )
    p.add_argument(
        "--max-loras", type=int, default=4, help="GPU adapter slots (default %(default)s)"
    )
    p.add_argument(
        "--max-cpu-loras", type=int, default=8, help="adapters cached in CPU (default %(default)s)"
    )
    p.add_argument(
        "--max-lora-rank", type=int, default=64, help="largest rank (default %(default)s)"
    )
    p.add_argument(
        "--max-tokens", type=int, default=32, help="per-line default (default %(default)s)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="per-line default; 0 = greedy (default %(default)s)",
    )
    p.add_argument(
        "--top-p", type=float, default=1.0, help="per-line default (default %(default)s)"
    )
    p.add_argument(
        "--seed", type=int, default=None, help="per-line default (default: none, unseeded)"
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=64, help="sequences per batch (default %(default)s)"
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    p.add_argument(
        "--dense-prompt-min",
        type=int,
        default=DENSE_PROMPT_MIN,
        help="on CUDA, whole prompts of this many tokens or more attend through dense "
        "SDPA, not the paged kernel; 0: never (default %(default)s)",
    )
    p.add_argument(
        "--no-kernel-warmup",
        action="store_true",
        help="on CUDA, compile the Triton kernels in the first step to need each instead of "
        "at start (a short job may end sooner)",
    )
    p.add_argument(
        "--input", required=True, type=Path, help="JSONL: {prompt, adapter, ...sampling fields}"
    )
    p.add_argument(
        "--output",
        required=True,
        type=Path,
        help="JSONL results in input order (written at the end)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from replica.offline import OfflineJob, parse_adapter_args  # lazy: torch is slow to import

    tmp = None
    try:
        _check_writable(args.output)
        tmp = _reserve(args.output)  # a file that cannot be made fails now, not after the run
        adapters = parse_adapter_args(args.adapter)
        lines = _read_lines(args.input)
        job = OfflineJob.from_args(args, adapters)
        results = job.run(lines, progress=not args.quiet)
        _write_into(tmp, args.output, results)
    except (LoraFleetError, ValueError, OSError) as e:
        print(f"lorafleet generate: {e}", file=sys.stderr)
        return 1
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)  # gone already when the output was written
    return 0


def _check_writable(path: Path) -> None:
    parent = path.parent
    if path.is_dir():
        raise ValueError(f"--output {path} is a directory; allowed: a file path")
    if not parent.is_dir():
        raise ValueError(f"--output {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--output {path}: directory {parent} is not writable")


def _reserve(path: Path) -> Path:
    """Create the temporary file the output is written to, beside path."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.open("x").close()
    except OSError as e:
        raise ValueError(f"--output {path}: cannot create a file beside it ({e.strerror})") from e
    return tmp


def _write_into(tmp: Path, path: Path, rows: list[dict]) -> None:
    """Write tmp, then rename it to path: a failure never leaves a half-written output."""
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def _read_lines(path: Path) -> list[InputLine]:
    lines = []
    # Bytes, decoded line by line: a text-mode read failed on bad UTF-8 with the codec's
    # message (a byte position in a read chunk), naming no line.
    with path.open("rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"line {i}: not UTF-8 (byte {e.start + 1} of the line)") from e
            if text.strip():
                lines.append(InputLine(i, _parse_line(text, i)))
    return lines


def _parse_line(text: str, i: int) -> dict:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"line {i}: not JSON ({e.msg})") from e
    except RecursionError as e:  # deep nesting overflows the decoder: not a ValueError
        raise ValueError(f"line {i}: JSON nested too deeply") from e
    except ValueError as e:  # an integer longer than int() converts (not a JSONDecodeError)
        digits = sys.get_int_max_str_digits()
        raise ValueError(
            f"line {i}: a number of more than {digits} digits; allowed: numbers of at most "
            f"{digits} digits"
        ) from e
    if not isinstance(row, dict) or "prompt" not in row:
        raise ValueError(f'line {i}: each line must be an object with a "prompt"')
    unknown = sorted(k for k in row if k not in LINE_FIELDS and not k.startswith("_"))
    if unknown:
        raise ValueError(
            f"line {i}: unknown field(s) {unknown}; allowed: {', '.join(sorted(LINE_FIELDS))}"
        )
    for name, (check, allowed) in FIELD_TYPES.items():
        if (
            name in row
            and not check(row[name])
            and not (name in NULL_IS_DEFAULT and row[name] is None)
        ):
            raise ValueError(f"line {i}: {name}={SHORT.repr(row[name])}; allowed: {allowed}")
    return row
