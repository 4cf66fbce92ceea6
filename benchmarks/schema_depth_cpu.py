"""CPU time xgrammar takes to compile a JSON schema of nested arrays, by depth: why
`replica.structured_spec.MAX_SPEC_DEPTH` refuses schemas nested more than 63 levels (the
figures quoted there and in docs/api.md). Each depth is compiled once, after one warm-up
compile, the way the ingress compiles a request's schema (`StructuredOutput.grammar`).
The floor it is set against: the same compile at the allowed depth, 63.

    python benchmarks/schema_depth_cpu.py --out benchmarks/results/schema_depth_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replica.structured_spec import MAX_SPEC_DEPTH, StructuredOutput  # noqa: E402


def nested(depth: int) -> str:
    """A schema `depth` levels of objects deep: arrays of arrays of ... integers."""
    return '{"type": "array", "items": ' * (depth - 1) + '{"type": "integer"}' + "}" * (depth - 1)


def compile_seconds(depth: int) -> float:
    start = time.process_time()
    StructuredOutput("json", nested(depth)).grammar()
    return time.process_time() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="63,100,200,400,900")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    compile_seconds(8)  # warm-up: xgrammar's first compile sets itself up
    floor = compile_seconds(MAX_SPEC_DEPTH)
    rows = []
    print(f"floor: depth {MAX_SPEC_DEPTH} (the allowed limit) {floor:.3f} s of CPU")
    for depth in (int(d) for d in args.depths.split(",")):
        seconds = compile_seconds(depth)
        rows.append({"depth": depth, "schema_chars": len(nested(depth)), "cpu_s": seconds})
        print(f"depth {depth:4d}  {len(nested(depth)):6d} chars  {seconds:8.3f} s  "
              f"({seconds / floor:.0f}x the depth-{MAX_SPEC_DEPTH} floor)")  # fmt: skip
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "command": "python " + " ".join(sys.argv),
                    "machine": platform.processor() or platform.machine(),
                    "floor_depth": MAX_SPEC_DEPTH,
                    "floor_cpu_s": floor,
                    "rows": rows,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
