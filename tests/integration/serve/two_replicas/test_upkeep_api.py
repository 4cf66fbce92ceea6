"""The two-replica cluster's upkeep: the app built from the embedded defaults, the local
Redis actor, a Redis outage that fails no health check.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.integration.serve.two_replicas.calls import PROMPT, complete
from tests.polling import wait_for

pytestmark = pytest.mark.integration


def test_build_app_with_embedded_defaults_registers_the_demo(cluster):
    """What `serve run deploy/cluster.yaml` does with its default args (without deploying)."""
    from ray.serve import Application

    from cluster.registry import Registry
    from deploy.builder import build_app
    from deploy.local_redis import ensure_local_redis

    args = {"demo_cache_dir": str(cluster.demo.model_dir.parent), "namespace": "embedded"}
    for _ in range(2):  # a second build finds everything in place
        assert isinstance(build_app(args), Application)
    reg = Registry(ensure_local_redis(), "embedded")
    listed = {a.record.name: a.record for a in reg.list_adapters()}
    reg.close()
    assert sorted(listed) == ["demo-chef", "demo-coder", "demo-poet"]
    assert all(r.public and r.version == 1 for r in listed.values())


def test_local_redis_actor_lives_with_the_cluster_and_is_reused(cluster):
    import redis

    from deploy.local_redis import ensure_local_redis

    url = ensure_local_redis()
    assert ensure_local_redis() == url
    client = redis.Redis.from_url(url)
    assert client.ping()
    client.close()


def test_a_redis_outage_does_not_fail_health_checks(cluster):
    import redis

    before = set(cluster.replica_actors())
    client = redis.Redis.from_url(cluster.redis_url)
    # Every Redis call stalls 7 s: longer than health_check_period_s (5 s, +-10% in Serve),
    # so Serve checks each replica's health at least once during the outage.
    client.execute_command("CLIENT", "PAUSE", 7000, "ALL")
    start = time.monotonic()
    # a registry that does not answer is a prompt 503, not a request held for 30 s
    r = httpx.post(
        f"{cluster.http}/v1/completions",
        headers={"Authorization": f"Bearer {cluster.keys['ops']}"},
        json={"model": "demo-poet", "prompt": PROMPT, "max_tokens": 2},
        timeout=30,
    )
    assert time.monotonic() - start < 5.0
    assert (r.status_code, r.headers["retry-after"]) == (503, "1")
    assert r.json()["error"]["code"] == "registry_unavailable"
    assert "did not answer within 3 s" in r.json()["error"]["message"]
    assert client.ping()  # the pause holds this call too: it returns once the outage ends
    client.close()
    assert set(cluster.replica_actors()) == before  # no replica was replaced
    assert complete(cluster, "demo-poet").choices[0].finish_reason == "length"
    reg = cluster.registry()
    wait_for(lambda: sum(r.live for r in reg.list_replicas()) >= 2, 10, "2 live replicas", 0.2)
    assert {r.replica_id for r in reg.list_replicas() if r.live} == before
    reg.close()
