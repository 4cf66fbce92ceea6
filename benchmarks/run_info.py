"""What a CPU benchmark's results file records about its run besides the figures."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time


def run_info(args: argparse.Namespace, load_at_start: float) -> dict:
    """The command, its arguments, the machine (with its load average at the start and
    now: the figures of a loaded machine read slower) and the time, for a results file."""
    return {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "config": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)},
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "loadavg_1m_at_start": load_at_start,
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
        },
        "when_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_results(args: argparse.Namespace, load_at_start: float, fields: dict) -> None:
    """Write run_info and fields (notes, results, ...) to args.out as JSON."""
    args.out.write_text(json.dumps({**run_info(args, load_at_start), **fields}, indent=2) + "\n")
    print(f"wrote {args.out}")
