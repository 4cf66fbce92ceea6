"""A replica killed under traffic: its own module-scoped cluster (2 replicas), since the
kill changes the fleet for whatever runs after it.

Requests that had not reached the dead replica, and non-streamed ones it was running
(the client has seen nothing yet), succeed on the other replica; a stream it was running
ends with a retryable `replica_failed` error event; the registry drops the dead replica.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import ray

from tests.integration.serve.cluster_fixture import start_cluster, stop_cluster
from tests.polling import wait_for

pytestmark = pytest.mark.integration
PROMPT = "hello world how are"
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("cluster"))
    yield c
    stop_cluster(c)


def greedy(cluster, model: str, max_tokens: int) -> str:
    r = httpx.post(
        f"{cluster.http}/v1/completions",
        headers={"Authorization": f"Bearer {cluster.keys['ops']}"},
        json={
            "model": model,
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def busy_replicas(cluster, at_least: int = 1) -> dict[str, object]:
    """Serve replica id -> actor of the replicas running or queueing at least `at_least`
    requests now."""
    actors = cluster.replica_actors()
    stats = cluster.routing_stats()
    return {rid: actors[rid] for rid, s in stats.items() if s["queue_len"] >= at_least}


def past_first_tokens(replica, steps: int = 2, timeout_s: float = 30.0) -> None:
    """Until `replica`'s engine has run `steps` more steps (its computed_tokens grew that
    often): each request of the first such step has had an output sent a step ago, so a
    kill now comes too late for the ingress's plain retry (only before the first output)."""

    def computed() -> int:
        return ray.get(replica.record_routing_stats.remote(), timeout=10)["computed_tokens"]

    seen = computed()
    for step in range(steps):
        seen = wait_for(
            lambda last=seen: (n := computed()) > last and n,
            timeout_s,
            f"engine step {step + 1} of {steps} on the replica to kill",
            interval_s=0.02,
        )


def test_a_stream_on_a_killed_replica_ends_with_a_retryable_error(cluster):
    """Killed while streaming: one SSE error event (503's code, retryable), then [DONE];
    not an 'internal error (ActorDiedError)'."""
    body = {
        "model": "demo-poet",
        "prompt": PROMPT,
        "max_tokens": 1000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {cluster.keys['ops']}"}
    events = []
    with httpx.stream(
        "POST", f"{cluster.http}/v1/completions", json=body, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        busy = busy_replicas(cluster)
        assert len(busy) == 1, busy
        ray.kill(next(iter(busy.values())), no_restart=True)
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert error["code"] == "replica_failed"
    assert error["type"] == "server_error"
    assert "send the request again" in error["message"]


def test_killing_a_replica_mid_traffic(cluster):
    cluster_wait_two_live(cluster)
    names = sorted(cluster.adapters)
    expected = {name: greedy(cluster, name, MAX_TOKENS) for name in names}
    actors = cluster.replica_actors()
    assert len(actors) == 2
    aclient = openai.AsyncOpenAI(
        base_url=f"{cluster.http}/v1", api_key=cluster.keys["ops"], max_retries=0
    )

    async def one(i):
        name = names[i % len(names)]
        try:
            r = await aclient.completions.create(
                model=name,
                prompt=PROMPT,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return r.choices[0].text == expected[name] or f"{name}: {r.choices[0].text!r}"
        except openai.APIError as e:
            return f"error {e}"

    victim_id = None

    async def traffic():
        nonlocal victim_id
        first = asyncio.gather(*[one(i) for i in range(16)])
        # kill a replica while it is running some of them, past their first tokens; the
        # polls run in threads, so this loop keeps the requests going meanwhile
        what = "a replica running 2 or more of the 16 requests"
        busy = await asyncio.to_thread(wait_for, lambda: busy_replicas(cluster, 2), 30, what, 0.05)
        victim_id, victim = sorted(busy.items())[0]
        await asyncio.to_thread(past_first_tokens, victim)
        ray.kill(victim, no_restart=True)
        return await first, await asyncio.gather(*[one(i) for i in range(8)])

    during, later = asyncio.run(traffic())
    # non-streamed: the killed replica's requests start again on the other replica
    assert during == [True] * 16
    assert later == [True] * 8
    reg = cluster.registry()
    # lapsed, or already reaped by a live replica's publisher (then it has no row at all)
    wait_for(
        lambda: {r.replica_id: r.live for r in reg.list_replicas()}.get(victim_id) in (False, None),
        15,
        f"the killed replica {victim_id}'s lease to lapse",
        interval_s=0.2,
    )
    assert all(loc.replica != victim_id for name in names for loc in reg.locations(name))
    reg.close()


def cluster_wait_two_live(cluster, timeout_s: float = 60.0) -> None:
    """Serve replaces a killed replica; wait until two live ones are registered."""
    reg = cluster.registry()

    def two_live() -> bool:
        actors = set(cluster.replica_actors())
        return len(actors) == 2 and {r.replica_id for r in reg.list_replicas() if r.live} == actors

    try:
        wait_for(two_live, timeout_s, "2 replicas, each live in the registry", interval_s=0.25)
    finally:
        reg.close()
