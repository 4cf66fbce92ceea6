"""Regenerate lorafleet_pb2.py / lorafleet_pb2_grpc.py: `python -m router.proto.regenerate`.

Runs grpc_tools.protoc on lorafleet.proto, then rewrites the generated absolute
import (`import lorafleet_pb2`) into a package import so the modules load as
`router.proto.lorafleet_pb2` from anywhere.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

HERE = Path(__file__).resolve().parent


def main() -> int:
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{HERE}",
            f"--python_out={HERE}",
            f"--grpc_python_out={HERE}",
            str(HERE / "lorafleet.proto"),
        ]
    )
    if rc != 0:
        return rc
    grpc_mod = HERE / "lorafleet_pb2_grpc.py"
    text = re.sub(
        r"^import lorafleet_pb2 as",
        "from router.proto import lorafleet_pb2 as",
        grpc_mod.read_text(),
        flags=re.M,
    )
    grpc_mod.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
