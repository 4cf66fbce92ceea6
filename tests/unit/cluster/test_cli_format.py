"""CLI formatting and the torch-free import rule."""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli.common import connection_parent, print_table
from cluster.client import DEFAULT_URL, redact
from deploy.cli import build_parser

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
    # the local redis-server's URL (a secrets.token_urlsafe password), and a password
    # holding the URL's own separators
    token = secrets.token_urlsafe(32)
    assert redact(f"redis://:{token}@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redact("redis://u:a:b@c@h:1/0") == "redis://u:***@h:1/0"
    assert redact("rediss://:s3cret@[::1]:1/0") == "rediss://:***@[::1]:1/0"


@pytest.mark.parametrize(
    "url, shown",
    [
        # redis-py takes any query argument as a connection argument: the password too
        # (a unix socket URL has no other place for it)
        ("redis://h:1/0?password=s3cret", "redis://h:1/0?password=***"),
        ("unix:///run/r.sock?db=2&password=s3cret", "unix:///run/r.sock?db=2&password=***"),
        ("redis://h/0?username=u&password=a%26b&password=c", "redis://h/0?username=u&password=***&password=***"),
        ("redis://:p@h/0?password=q", "redis://:***@h/0?password=***"),
        ("redis://h/0?db=1", "redis://h/0?db=1"),
    ],
)  # fmt: skip
def test_redact_hides_a_password_in_the_query(url, shown):
    assert redact(url) == shown


def test_cluster_never_imports_torch():
    code = (
        "import cluster.registry, cluster.cli.main, cluster.lease, cluster.autoscaling, sys; "
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


@pytest.mark.parametrize("value", ["", None])
def test_empty_or_unset_env_falls_back_to_defaults(monkeypatch, value: str | None):
    for name in ("LORAFLEET_REDIS_URL", "LORAFLEET_NAMESPACE", "LORAFLEET_MAX_LORA_RANK"):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["adapters", "register", "a", "/p"])
    # max_lora_rank None: the cluster's published limit (or 64 without one), see _register
    assert (args.redis_url, args.namespace, args.max_lora_rank) == (DEFAULT_URL, "lorafleet", None)


def test_env_and_flags_still_win(monkeypatch):
    monkeypatch.setenv("LORAFLEET_REDIS_URL", "redis://h:1/2")
    monkeypatch.setenv("LORAFLEET_MAX_LORA_RANK", "16")
    args = build_parser().parse_args(["adapters", "register", "a", "/p", "--namespace", "ns"])
    assert (args.redis_url, args.namespace, args.max_lora_rank) == ("redis://h:1/2", "ns", 16)
    assert connection_parent().parse_args(["--redis-url", "redis://x:2/0"]).redis_url == (
        "redis://x:2/0"
    )
