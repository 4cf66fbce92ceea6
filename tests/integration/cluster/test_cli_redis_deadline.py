"""A Redis that accepts connections but answers nothing (SIGSTOP) fails every admin verb
within seconds, in one line; a slow Redis that does answer, and big catalogs, still work.

Before the sync client had a deadline, a stopped Redis held the CLI for (retries + 1) x
socket timeout = 15 s."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cluster import ops
from cluster.client import RetryPolicy
from cluster.records import AdapterRecord
from cluster.registry import Registry
from lora_core.errors import RegistryUnavailable
from tests.integration.cluster.timing import StallMeter
from tests.redis_fixture import free_port, start_redis

ROOT = Path(__file__).resolve().parents[3]
NO_ANSWER = "did not answer within {} s (retries included); allowed: a Redis that answers, "
CLI_HINT = "retry later, or a longer --redis-timeout (env LORAFLEET_REDIS_TIMEOUT)"
ACME_JSON = '[\n  {\n    "requests_per_minute": 0,\n    "tenant": "acme"\n  }\n]\n'


def _cli(url: str, *argv: str, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """(the finished `python -m cluster.cli argv --redis-url url`, its wall time in s)."""
    full_env = {k: v for k, v in os.environ.items() if k != "LORAFLEET_REDIS_TIMEOUT"}
    full_env.update(PYTHONPATH=str(ROOT), LORAFLEET_NAMESPACE="t", **env)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", *argv, "--redis-url", url],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc, time.monotonic() - start


def _redis_pid(url: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return int(client.info("server")["process_id"])
    finally:
        client.close()


@pytest.fixture
def stoppable(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """(url, pid) of a redis-server of this test alone, which the test may SIGSTOP."""
    url, stop = start_redis(tmp_path)
    pid = _redis_pid(url)
    yield url, pid
    os.kill(pid, signal.SIGCONT)  # a stopped process would ignore SIGTERM until continued
    stop()


@pytest.mark.parametrize(
    "argv, env, deadline, bound_s",
    [
        (("status",), {}, "3", 5.0),
        (("adapters", "list", "--json"), {}, "3", 5.0),
        (("tenants", "list", "--redis-timeout", "1"), {}, "1", 2.5),
        (("replicas", "list"), {"LORAFLEET_REDIS_TIMEOUT": "0.5"}, "0.5", 2.0),
    ],
)
def test_stopped_redis_fails_within_the_deadline(stoppable, argv, env, deadline, bound_s):
    url, pid = stoppable
    os.kill(pid, signal.SIGSTOP)
    with StallMeter() as stalled:
        proc, wall = _cli(url, *argv, **env)
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == (
        f"lorafleet: error: Redis at {url} {NO_ANSWER.format(deadline)}{CLI_HINT}\n"
    )
    # the deadline + the interpreter's start (~0.4 s on 2 cores) + what the machine stalled
    assert wall < bound_s + stalled.stall_s


def test_slow_redis_that_answers_still_works(stoppable):
    url = stoppable[0]
    pauser = redis.Redis.from_url(url)
    pauser.execute_command("CLIENT", "PAUSE", 1500, "ALL")  # answers after 1.5 s
    proc, wall = _cli(url, "tenants", "create", "acme")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "created tenant acme\n", "")
    assert wall > 1.0
    # slower than the deadline (by more than the CLI takes to start, ~0.5 s)
    pauser.execute_command("CLIENT", "PAUSE", 4000, "ALL")
    proc, wall = _cli(url, "tenants", "list", "--json", "--redis-timeout", "1")
    assert proc.returncode == 1 and NO_ANSWER.format(1) in proc.stderr
    pauser.execute_command("CLIENT", "PAUSE", 4000, "ALL")
    proc, wall = _cli(url, "tenants", "list", "--json", "--redis-timeout", "10")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, ACME_JSON, "")
    assert wall > 3.0
    pauser.close()


def test_a_big_catalog_lists_within_a_short_deadline(redis_url: str):
    """10k adapters: `adapters list` pages them (256 names a script), so every command
    stays far below even a 1 s deadline."""
    reg = Registry(redis_url, "t")
    for i in range(10_000):
        rec = AdapterRecord(
            f"a{i:05d}", 0, "0" * 64, f"/a/{i}", 8, "m", ("q_proj",), "", True, 0.0, "active"
        )
        reg._run(ops.register_adapter(rec, False))
    reg.close()
    proc, wall = _cli(redis_url, "adapters", "list", "--redis-timeout", "1")
    assert (proc.returncode, proc.stderr) == (0, "")
    lines = proc.stdout.splitlines()
    assert len(lines) == 10_001 and lines[1].split()[0] == "a00000"
    assert lines[-1].split()[0] == "a09999"


def test_sync_registry_gives_up_at_its_deadline_and_recovers(stoppable):
    """The sync client (the CLI's, the app builder's) has the asyncio client's deadline:
    without it a stopped Redis held a command for (retries + 1) x socket_timeout_s."""
    url, pid = stoppable
    reg = Registry(url, "t", retry=RetryPolicy(retries=5, socket_timeout_s=5.0, deadline_s=0.5))
    reg.create_tenant("t1")
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    with (
        StallMeter() as stalled,
        pytest.raises(RegistryUnavailable, match=re.escape(NO_ANSWER.format("0.5"))),
    ):
        reg.list_tenants()
    assert time.monotonic() - start < 1.0 + stalled.stall_s
    os.kill(pid, signal.SIGCONT)
    assert reg.list_tenants() == ["t1"]  # the same client works again with Redis
    reg.close()


def test_retries_stop_at_the_deadline():
    """Connection refused again and again: retries left, but the deadline ends them."""
    closed = f"redis://127.0.0.1:{free_port()}/0"
    policy = RetryPolicy(retries=1000, backoff_base_s=0.01, backoff_cap_s=0.02, deadline_s=0.5)
    reg = Registry(closed, "t", retry=policy)
    start = time.monotonic()
    with (
        StallMeter() as stalled,
        pytest.raises(RegistryUnavailable, match=f"cannot reach Redis at {closed}: "),
    ):
        reg.list_tenants()
    assert 0.4 < time.monotonic() - start < 1.0 + stalled.stall_s
    reg.close()
