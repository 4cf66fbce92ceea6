"""CLI formatting and the torch-free import rule."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cluster.cli.common import print_table
from cluster.client import redact

ROOT = Path(__file__).resolve().parents[3]


def test_print_table_aligns_columns(capsys):
    print_table(("A", "BEE"), [("long-value", 1), ("x", 22)])
    assert capsys.readouterr().out.splitlines() == [
        "A           BEE",
        "long-value  1",
        "x           22",
    ]


def test_redact_hides_password():
    assert redact("redis://:s3cret@h:1/0") == "redis://:***@h:1/0"
    assert redact("redis://u:s3cret@h:1/0") == "redis://u:***@h:1/0"
    assert redact("redis://h:1/0") == "redis://h:1/0"


def test_cluster_never_imports_torch():
    code = (
        "import cluster.registry, cluster.cli.main, cluster.lease, sys; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
