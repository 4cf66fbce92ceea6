"""Regenerate lorafleet_pb2.py / lorafleet_pb2_grpc.py: `python -m router.proto.regenerate`.

Equivalent to, from the repository root:
    python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. router/proto/lorafleet.proto
Compiling with the repository root as the include path makes the generated modules
(and their message classes, which Ray pickles) live at `router.proto.lorafleet_pb2`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    return protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"--python_out={ROOT}",
            f"--grpc_python_out={ROOT}",
            str(ROOT / "router" / "proto" / "lorafleet.proto"),
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
