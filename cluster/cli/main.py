"""Admin verbs of the `lorafleet` CLI (registered into deploy/cli.py's parser)."""

from __future__ import annotations

import argparse


def register_commands(sub: argparse._SubParsersAction) -> None:
    """Add the admin subcommands (adapters, replicas, tenants, status). Each sets `func`."""
