"""`python -m cluster.cli ...`: the admin verbs alone (torch-free, fast to start).

The full `lorafleet` entry point is deploy/cli.py, which adds offline generation.
"""

from __future__ import annotations

import argparse
import sys

from cluster.cli.main import register_commands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lorafleet", description="lorafleet admin verbs.")
    register_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
