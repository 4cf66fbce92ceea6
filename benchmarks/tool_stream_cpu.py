"""Tool-call readers fed a long answer a few characters at a time (CPU, one thread).

Each parser reads one call whose argument is n characters long, fed PIECE characters per
`feed` as a stream would; the figure is the best of RUNS runs' CPU time. Run it against
an older tree to compare (the importable `router` is the one timed):

    python3 benchmarks/tool_stream_cpu.py --out benchmarks/results/tool_stream_cpu.json
    PYTHONPATH=/tmp/old python3 benchmarks/tool_stream_cpu.py --label old --out OLD.json
    python3 benchmarks/tool_stream_cpu.py --baseline OLD.json --out NEW.json   # ratios

With --baseline each row prints the baseline's time and the ratio beside its own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import router
from router.tool_parsers import HermesCalls, Llama3Calls, MistralCalls, PythonicCalls

NAMES = {"get_weather", "now"}


def answers(n: int) -> dict[str, tuple[type, str]]:
    """One call per parser form, its argument n characters long."""
    arg = "x" * n
    obj = json.dumps({"name": "get_weather", "arguments": {"city": arg}})
    return {
        "hermes": (HermesCalls, f"<tool_call>{obj}</tool_call>"),
        "llama3_json": (
            Llama3Calls,
            json.dumps({"name": "get_weather", "parameters": {"city": arg}}),
        ),
        "llama3_object_whole": (
            Llama3Calls,
            json.dumps({"parameters": {"city": arg}, "name": "get_weather"}),
        ),
        "mistral_array": (MistralCalls, f"[TOOL_CALLS][{obj}]"),
        "mistral_named": (MistralCalls, '[TOOL_CALLS]get_weather{"city": "' + arg + '"}'),
        "pythonic": (PythonicCalls, '[get_weather(city="' + arg + '")]'),
    }


def cpu_ms(make: type, text: str, piece: int) -> float:
    reader = make(names=NAMES)
    start = time.process_time()
    for i in range(0, len(text), piece):
        reader.feed(text[i : i + piece])
    reader.end()
    return (time.process_time() - start) * 1000


def revision() -> str:
    root = Path(router.__file__).resolve().parents[1]
    out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)  # fmt: skip
    return out.stdout.strip() or str(root)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="20000,80000,320000", help="argument lengths")
    ap.add_argument("--piece", type=int, default=1, help="characters per feed")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--label", default="")
    ap.add_argument("--baseline", type=Path, help="an earlier --out file to compare with")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    base = {}
    if args.baseline:
        doc = json.loads(args.baseline.read_text())
        base = {(r["parser"], r["chars"]): r["cpu_ms"] for r in doc["rows"]}
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        for name, (make, text) in answers(n).items():
            ms = min(cpu_ms(make, text, args.piece) for _ in range(args.runs))
            rows.append({"parser": name, "chars": len(text), "cpu_ms": round(ms, 1)})
            was = base.get((name, len(text)))
            beside = f"  baseline {was:9.1f} ms  x{was / ms:5.2f}" if was else ""
            print(f"{name:20s} {len(text):7d} chars {ms:9.1f} ms{beside}", flush=True)
    doc = {
        "command": "python3 benchmarks/tool_stream_cpu.py "
        + " ".join(
            f"--{k} {v}" for k, v in vars(args).items() if v not in (None, "") and k != "out"
        ),
        "tree": args.label or revision(),
        "piece": args.piece,
        "runs": args.runs,
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
