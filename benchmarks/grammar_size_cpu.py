"""Host memory of compiled grammars (CPU): xgrammar's `memory_size_bytes` of a few specs
compiled over a 128k synthetic vocabulary (`synthetic_vocab.py`), with the compile time,
beside the replica's cache bound (`replica.structured.CACHE_BYTES`, `CACHE_SIZE`): how
many of each would fit, and what the count bound alone would let them hold.

    python3 benchmarks/grammar_size_cpu.py --out benchmarks/results/grammar_size_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from synthetic_vocab import synthetic_tokenizer  # noqa: E402

from replica.structured import CACHE_BYTES, CACHE_SIZE, Grammars  # noqa: E402
from replica.structured_spec import StructuredOutput  # noqa: E402

VOCAB = 128256
OBJECT = json.dumps(
    {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "string", "maxLength": 30},
            "c": {"type": "array", "items": {"type": "number"}},
        },
        "required": ["a", "b", "c"],
    }
)
SPECS = [
    (
        "json array of strings",
        StructuredOutput("json", '{"type":"array","items":{"type":"string"}}'),
    ),
    ("json object, 3 properties", StructuredOutput("json", OBJECT)),
    ("json_object (any object)", StructuredOutput("json_object")),
    ("regex email-like", StructuredOutput("regex", r"[a-z]{1,40}@[a-z]+\.com")),
    ("regex 5 digits", StructuredOutput("regex", r"[0-9]{5}")),
    ("choice of 3", StructuredOutput("choice", ("yes", "no", "maybe"))),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    tok = synthetic_tokenizer(128000)
    grammars = Grammars(tok, VOCAB, [tok.eos_token_id])
    rows = []
    print(f"cache bound: {CACHE_BYTES / 2**20:.0f} MiB and {CACHE_SIZE} grammars")
    print(f"{'spec':28s} | {'MB':>7s} | compile s | fit in bound | {CACHE_SIZE} would hold")
    for name, spec in SPECS:
        t0 = time.perf_counter()
        size = grammars.compile(spec).memory_size_bytes
        secs = time.perf_counter() - t0
        row = {
            "spec": name,
            "kind": spec.kind,
            "bytes": size,
            "compile_s": secs,
            "fit_in_bytes_bound": min(CACHE_SIZE, CACHE_BYTES // max(size, 1)),
            "count_bound_alone_GB": CACHE_SIZE * size / 1e9,
        }
        rows.append(row)
        print(f"{name:28s} | {size / 1e6:7.2f} | {secs:9.3f} | {row['fit_in_bytes_bound']:12d} | "
              f"{row['count_bound_alone_GB']:.2f} GB")  # fmt: skip
    if args.out:
        doc = {
            "command": "python3 " + " ".join(sys.argv),
            "machine": "development machine (2 cores), CPU",
            "vocabulary": f"synthetic {VOCAB}",
            "cache_bytes": CACHE_BYTES,
            "cache_size": CACHE_SIZE,
            "rows": rows,
        }
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
