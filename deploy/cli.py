"""The `lorafleet` command: offline generation plus the admin verbs of `cluster.cli`.

Exit codes: 0 success, 1 error (one-line message on stderr), 2 usage error.
"""

from __future__ import annotations

import argparse
import sys

from cluster.cli.main import register_commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lorafleet", description="Multi-tenant LoRA serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    from replica.offline_cli import register_generate

    register_generate(sub)
    register_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
