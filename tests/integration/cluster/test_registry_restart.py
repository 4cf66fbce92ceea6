"""Redis restarts mid-test: clients reconnect, leases re-register, the CLI fails clearly."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cluster.client import RetryPolicy
from cluster.lease import LeaseConfig, ReplicaLease
from cluster.records import Location
from cluster.registry import AsyncRegistry, Registry
from lora_core.errors import AdapterVersionUnavailable, RegistryUnavailable
from replica.outputs import EngineStats
from replica.serve_protocol import check_version
from replica.serve_registry import PublisherConfig, RegistryPublisher
from tests.integration.cluster.timing import StallMeter
from tests.redis_fixture import free_port, start_redis

ROOT = Path(__file__).resolve().parents[3]
FAST = RetryPolicy(retries=1, backoff_base_s=0.02, backoff_cap_s=0.05, connect_timeout_s=0.2)
PATIENT = RetryPolicy(retries=40, backoff_base_s=0.05, backoff_cap_s=0.1, connect_timeout_s=0.2)


def _cli(url: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LORAFLEET_REDIS_URL": url}
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def restartable(tmp_path: Path):
    """(url, restart, stop): one redis-server on a fixed port that tests may bounce."""
    port = free_port()
    state = {"stop": start_redis(tmp_path / "0", port)[1], "n": 0}

    def restart_later(delay_s: float) -> threading.Thread:
        def go() -> None:
            threading.Event().wait(delay_s)
            state["n"] += 1
            state["stop"] = start_redis(tmp_path / str(state["n"]), port)[1]

        t = threading.Thread(target=go)
        t.start()
        return t

    yield f"redis://127.0.0.1:{port}/0", restart_later, lambda: state["stop"]()
    state["stop"]()


def test_restart_clients_reconnect_and_leases_reregister(restartable, adapters):
    url, restart_later, stop = restartable
    reg = Registry(url, "t", retry=FAST)
    reg.register_adapter("a", str(adapters["a"]))
    epochs: list[int] = []

    def on_register(epoch: int) -> None:
        epochs.append(epoch)
        reg.report_resident("r1", epoch, ("a", 1), "gpu")

    lease = ReplicaLease(
        reg, LeaseConfig("r1", "mixed", "d", 4, ttl_s=5.0, interval_s=1.0), on_register
    )
    assert lease.beat() == 1
    stop()
    with pytest.raises(RegistryUnavailable, match=f"cannot reach Redis at {url}"):
        reg.get_adapter("a")
    assert lease.beat() is None  # down: the beat reports, does not raise
    down = _cli(url, "adapters", "list")
    assert down.returncode == 1
    assert down.stdout == ""
    assert down.stderr.startswith(f"lorafleet: error: cannot reach Redis at {url}")
    assert down.stderr.count("\n") == 1
    restart_later(0.0).join()
    # persistence is off: the restarted Redis is empty; the same client reconnects
    assert reg.status().adapters == 0
    reg.register_adapter("a", str(adapters["a"]))
    assert lease.beat() == 1  # its lease is gone: re-registered on the next beat
    assert epochs == [1, 1]
    assert reg.locations("a") == (Location("r1", "gpu", "mixed"),)
    assert _cli(url, "status", "--json").returncode == 0
    reg.close()


def test_retry_policy_rides_out_a_short_outage(restartable):
    url, restart_later, stop = restartable
    reg = Registry(url, "t", retry=PATIENT)
    epoch = reg.register_replica("r1", "mixed", "d", 4, 30.0)
    stop()
    t = restart_later(0.4)
    # blocks in the client's retry loop until Redis is back, then succeeds
    assert reg.register_replica("r1", "mixed", "d", 4, 30.0) == 1
    t.join()
    assert epoch == 1
    reg.close()


def test_async_client_reconnects(restartable):
    url, restart_later, stop = restartable

    async def scenario() -> None:
        reg = AsyncRegistry(url, "t", retry=FAST)
        await reg.create_tenant("t1")
        stop()
        with pytest.raises(RegistryUnavailable, match=f"cannot reach Redis at {url}"):
            await reg.list_tenants()
        await asyncio.to_thread(lambda: restart_later(0.0).join())
        assert await reg.list_tenants() == []
        await reg.create_tenant("t1")
        assert await reg.list_tenants() == ["t1"]
        await reg.close()

    asyncio.run(scenario())


def test_desired_versions_never_repeat_across_a_restart(restartable, adapters):
    """A replica skips a desired-state version equal to the one it applied last; after
    Redis restarts empty the same number of changes must not land on that version."""
    url, restart_later, stop = restartable
    reg = Registry(url, "t", retry=FAST)

    def setup(pins: tuple[str, ...]) -> int:
        for name in ("a", "b", "c"):
            reg.register_adapter(name, str(adapters["a"]))
        for name in pins:
            reg.pin(name)
        return reg.desired_state().version

    applied = setup(("a", "b"))
    stop()
    restart_later(0.0).join()
    assert reg.desired_state().version == 0  # empty: differs from any applied version
    after = setup(("c", "a"))  # as many changes as before, different pins
    assert after > applied
    assert reg.desired_state().pins == {"c": "all", "a": "all"}
    reg.client.flushall()  # the same without a restart
    assert setup(("b", "c")) > after
    reg.close()


def test_replicas_serve_versions_handed_out_after_an_empty_restart(restartable, adapters):
    """An empty restart resets `{ns}:version:{name}`: a name registered again gets version
    1, which a replica that saw version 3 before would refuse as replaced (retried
    forever). Its publisher sees its epoch go back, and forgets the old versions."""
    url, restart_later, stop = restartable
    reg = Registry(url, "t", retry=FAST)

    class Engine:
        def stats(self) -> EngineStats:
            return EngineStats((), (), (), 4, 4, 0, 0, 0.0, 0, 0, 0)

    async def scenario() -> None:
        areg = AsyncRegistry(url, "t", retry=FAST)
        pub = RegistryPublisher(PublisherConfig("r1", "d"), areg, Engine(), {})
        await pub.tick()
        for replace in (False, True, True):  # a request for each version reached r1
            ref = reg.register_adapter("a", str(adapters["a"]), replace=replace).ref
            check_version(ref, pub.newest_version)
        await pub.tick()
        stop()
        await asyncio.to_thread(lambda: restart_later(0.0).join())
        fresh = reg.register_adapter("a", str(adapters["b"])).ref
        assert fresh.version == 1
        with pytest.raises(AdapterVersionUnavailable):
            check_version(fresh, dict(pub.newest_version))  # what r1 did before the fix
        await pub.tick()  # the lease is gone: r1 registers again, with epoch 1
        check_version(fresh, pub.newest_version)
        assert pub.newest_version == {"a": 1}
        # a lease that merely lapsed (no restart) keeps what the replica has seen
        pub.epoch = None
        await pub.tick()
        assert (pub.epoch, pub.newest_version) == (2, {"a": 1})
        await areg.close()

    asyncio.run(scenario())
    reg.close()


def test_async_client_gives_up_on_a_redis_that_does_not_answer(restartable):
    """A paused Redis accepts connections but answers nothing: the asyncio client (the
    ingress, the replicas) raises RegistryUnavailable at its deadline, instead of waiting
    (retries + 1) x socket_timeout_s (30 s with the default policy)."""
    import time

    import redis

    url = restartable[0]
    policy = RetryPolicy(retries=5, socket_timeout_s=5.0, deadline_s=0.5)

    async def scenario() -> None:
        reg = AsyncRegistry(url, "t", retry=policy)
        await reg.create_tenant("t1")
        pauser = redis.Redis.from_url(url)
        pauser.execute_command("CLIENT", "PAUSE", 3000, "ALL")
        start = time.monotonic()
        with (
            StallMeter() as stalled,
            pytest.raises(RegistryUnavailable, match="did not answer within 0.5 s"),
        ):
            await reg.list_tenants()
        assert time.monotonic() - start < 1.5 + stalled.stall_s
        pauser.execute_command("CLIENT", "UNPAUSE")
        pauser.close()
        assert await reg.list_tenants() == ["t1"]  # the client recovers with Redis
        await reg.close()

    asyncio.run(scenario())
