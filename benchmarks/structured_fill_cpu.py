"""Host cost of structured outputs' token masks (CPU): microseconds to fill one row's
mask with xgrammar over a 128k synthetic vocabulary (`synthetic_vocab.py`), on one
thread, in a few grammar states, JSON compact and with free whitespace (at most --bound
characters per gap, FREE_WHITESPACE by default). The floor beside each figure is the
row's bitmask bytes written once at the copy speed of this machine (numpy, same run).

    python3 benchmarks/structured_fill_cpu.py --out benchmarks/results/structured_fill_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from synthetic_vocab import synthetic_tokenizer  # noqa: E402

from replica.structured import Grammars  # noqa: E402
from replica.structured_spec import FREE_WHITESPACE, StructuredOutput  # noqa: E402

ROWS = 64
VOCAB = 128256
PERSON = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
)
STRINGS = '{"type": "array", "items": {"type": "string"}}'


def cases(ws: int) -> list[tuple[str, StructuredOutput, str]]:
    """(name, spec, the text each row's matcher has accepted before the timed fill); ws:
    the free-whitespace cases' bound."""
    return [
        ("json object, expecting a key", StructuredOutput("json", PERSON), '{'),
        ("json array of strings, inside a string", StructuredOutput("json", STRINGS), '["ab'),
        (f"json object, whitespace <= {ws}, expecting a key", StructuredOutput("json", PERSON, ws), '{'),
        (f"json object, whitespace <= {ws}, after a newline", StructuredOutput("json", PERSON, ws), '{\n  '),
        (f"json strings, whitespace <= {ws}, inside a string", StructuredOutput("json", STRINGS, ws), '["ab'),
        ("json_object, expecting a key", StructuredOutput("json_object"), '{'),
        (f"json_object, whitespace <= {ws}, expecting a key", StructuredOutput("json_object", whitespace=ws), '{'),
        ("regex [a-z ]{1,40}\\., after 2 letters", StructuredOutput("regex", r"[a-z ]{1,40}\."), "ab"),
        ("choice of 3", StructuredOutput("choice", ("alpha", "beta", "gamma")), "al"),
    ]  # fmt: skip


def main() -> None:
    import xgrammar as xgr

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--bound", type=int, default=FREE_WHITESPACE,
                    help="whitespace characters per gap of the free-whitespace cases")  # fmt: skip
    args = ap.parse_args()
    tok = synthetic_tokenizer()
    grammars = Grammars(tok, VOCAB, [tok.eos_token_id])
    bits = xgr.allocate_token_bitmask(ROWS, VOCAB)
    one_thread = xgr.BatchGrammarMatcher(max_threads=1)
    src = np.ones(64 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # pages touched before the timed copy
    t = time.perf_counter()
    np.copyto(dst, src)
    copy_bps = 2 * src.nbytes / (time.perf_counter() - t)
    del src, dst
    floor_us = bits[0].numel() * 4 / copy_bps * 1e6
    doc = {"command": "python3 " + " ".join(sys.argv), "rows": ROWS, "vocab": VOCAB,
           "threads": 1, "floor_us_per_row": floor_us, "results": []}  # fmt: skip
    print(f"floor (one row's {bits[0].numel() * 4} bitmask bytes at {copy_bps / 1e9:.1f} GB/s): "
          f"{floor_us:.2f} us per row")  # fmt: skip
    for name, spec, prefix in cases(args.bound):
        t = time.perf_counter()
        grammars.compile(spec)
        compile_ms = (time.perf_counter() - t) * 1e3
        matchers = [grammars.matcher(spec) for _ in range(ROWS)]
        for m in matchers:
            assert m.accept_string(prefix), (name, prefix)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            one_thread.batch_fill_next_token_bitmask(matchers, bits)
            times.append((time.perf_counter() - t) / ROWS * 1e6)
        us = sorted(times)[len(times) // 2]
        doc["results"].append({"case": name, "compile_ms": compile_ms, "fill_us_per_row": us})
        print(f"{name:50s} compile {compile_ms:7.1f} ms  fill {us:8.1f} us/row "
              f"(floor {floor_us:.2f})", flush=True)  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
