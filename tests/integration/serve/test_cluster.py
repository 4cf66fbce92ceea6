"""End-to-end: the OpenAI client, httpx and a gRPC client against one real cluster.

One module-scoped app (see cluster_fixture.py); killing replicas is in
test_replica_failure.py.
Expected greedy outputs come from an in-process offline `LLMEngine` on the same
model and adapter directories.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import uuid
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from cluster.records import key_id
from cluster.registry import hash_key
from replica.config import EngineConfig
from router.proto import lorafleet_pb2 as pb
from tests.integration.serve.cluster_fixture import (
    ADMIN_KEY,
    assert_offsets_match,
    gpu_holders,
    misfit_adapters,
    offline_greedy_texts,
    start_cluster,
    stop_cluster,
    total_loads,
)
from tests.polling import wait_for

pytestmark = pytest.mark.integration
PROMPT = "hello world how are"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("cluster"))
    yield c
    stop_cluster(c)


@pytest.fixture(scope="module")
def offline(cluster):
    """model name -> greedy text of PROMPT, from an offline LLMEngine."""
    return offline_greedy_texts(cluster, PROMPT, MAX_TOKENS)


def client(cluster, key="ops") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.http}/v1", api_key=cluster.keys[key], max_retries=0)


def complete(cluster, model, key="ops", **kw) -> str:
    r = client(cluster, key).completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, **kw
    )
    return r


def test_greedy_output_equals_offline(cluster, offline):
    for model in [cluster.base, "demo-poet", "demo-coder", "demo-chef", "extra-1"]:
        r = complete(cluster, model)
        assert r.choices[0].text == offline[model], model
        assert r.usage.completion_tokens == MAX_TOKENS
        assert r.model == model


def test_streamed_equals_non_streamed(cluster):
    c = client(cluster)
    for model in [cluster.base, "demo-poet"]:
        whole = complete(cluster, model).choices[0].text
        stream = c.completions.create(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        assert "".join(ch.choices[0].text for ch in stream) == whole
        msgs = [{"role": "user", "content": "what is lorafleet"}]
        chat = c.chat.completions.create(
            model=model, messages=msgs, max_tokens=MAX_TOKENS, temperature=0
        )
        chunks = c.chat.completions.create(
            model=model,
            messages=msgs,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts, usage, finish = [], None, None
        for ch in chunks:
            if ch.choices:
                parts.append(ch.choices[0].delta.content or "")
                finish = ch.choices[0].finish_reason or finish
            if ch.usage:
                usage = ch.usage
        assert "".join(parts) == chat.choices[0].message.content
        assert finish == chat.choices[0].finish_reason
        assert usage.completion_tokens == chat.usage.completion_tokens
        assert usage.prompt_tokens == chat.usage.prompt_tokens


def test_logprobs_cover_every_sampled_token(cluster):
    r = complete(cluster, "demo-poet", logprobs=3)
    lp, text = r.choices[0].logprobs, r.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == MAX_TOKENS
    assert all(x <= 0.0 for x in lp.token_logprobs)
    assert_offsets_match(text, lp.tokens, lp.text_offset)
    for tok, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # Greedy: the sampled token leads the 3 most likely, each its own key.
        assert top[tok] == x == max(top.values()) and len(top) == 3
    stream = client(cluster).completions.create(
        model="demo-poet",
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=3,
        stream=True,
    )
    offsets = [o for ch in stream for o in ch.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset
    chat = client(cluster).chat.completions.create(
        model="demo-poet",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    # A random tiny model emits invalid UTF-8 too: the text shows it as U+FFFD.
    raw = bytes(b for c in content for b in c.bytes)
    assert raw.decode(errors="replace") == chat.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2
        assert (c.top_logprobs[0].token, c.top_logprobs[0].logprob) == (c.token, c.logprob)
    with pytest.raises(openai.BadRequestError, match="allowed: 0 to 20"):
        complete(cluster, "demo-poet", logprobs=21)


def test_eight_adapters_on_two_replicas_under_concurrent_load(cluster, offline):
    names = sorted(cluster.adapters)
    assert len(names) == 8
    aclient = openai.AsyncOpenAI(
        base_url=f"{cluster.http}/v1", api_key=cluster.keys["ops"], max_retries=0
    )

    async def one(model):
        r = await aclient.completions.create(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
        )
        return model, r.choices[0].text

    async def go():
        return await asyncio.gather(*[one(m) for m in names * 3])

    results = asyncio.run(go())
    assert len(results) == 24
    for model, text in results:
        assert text == offline[model], model


def slot_holders(stats: dict[str, dict], name: str) -> set[str]:
    """Replicas whose routing stats (`Cluster.routing_stats`) show `name` in a GPU slot."""
    return {rid for rid, s in stats.items() if any(k.startswith(f"{name}@") for k in s["gpu"])}


def chef_counters(cluster) -> tuple[float, float]:
    """demo-chef's finished-request and generated-token counters (Prometheus)."""
    return (
        cluster.counter("requests_total", model="demo-chef", finish_reason="length"),
        cluster.counter("generated_tokens_total", model="demo-chef"),
    )


def test_affinity_repeated_requests_stay_on_the_holder(cluster):
    complete(cluster, "demo-chef")  # make it resident somewhere
    settled = time.monotonic()  # from here on only a load (counted below) moves adapters

    def registry_in_step() -> set[str]:
        """The registry's GPU holders (each request's residency) once they match the
        replicas' own slots, else none."""
        listed = gpu_holders(cluster, "demo-chef")
        return listed if listed == slot_holders(cluster.routing_stats(), "demo-chef") else set()

    # The earlier concurrent test may have left it on one replica or on both.
    what = "the registry listing demo-chef on the replicas that hold it"
    holders_before = wait_for(registry_in_step, 20, what, interval_s=0.1)
    loads_before = total_loads(cluster)
    # The router also ranks by the routing stats Serve's controller polls from each replica
    # (every 0.5 s, cluster_args) and pushes to the ingress: stale ones may still show
    # demo-chef on a replica the concurrent test evicted it from. Nothing outside the
    # ingress shows its copy, so let two periods pass since residency settled (Prometheus,
    # exported every 0.5 s, takes in the counts of the requests so far meanwhile).
    time.sleep(max(0.0, settled + 1.0 - time.monotonic()))
    counted = chef_counters(cluster)
    for _ in range(8):
        complete(cluster, "demo-chef")
    # each load happens before its request runs: the counts are final once they return
    assert total_loads(cluster) == loads_before
    holders = gpu_holders(cluster, "demo-chef")
    assert holders == holders_before and len(holders) >= 1
    stats = cluster.routing_stats()
    assert slot_holders(stats, "demo-chef") == holders
    # The same numbers reach Ray's metrics (Prometheus, exported every 0.5 s).
    loads = {rid: float(s["adapter_loads"]) for rid, s in stats.items()}
    wait_for(
        lambda: cluster.gauge("adapter_loads") == loads,
        10,
        f"the adapter_loads gauges to read {loads}",
        interval_s=0.5,
    )
    # per-model request and token counters, exported as each request ends
    want = (counted[0] + 8, counted[1] + 8 * MAX_TOKENS)
    wait_for(
        lambda: chef_counters(cluster) == want,
        10,
        f"demo-chef's request and token counters to read {want}",
        interval_s=0.5,
    )


def test_the_choices_of_a_request_share_one_replica_and_its_prompt(cluster):
    """Base-model choices (no adapter holder draws them together) go to one replica, which
    computes their prompt once: the 3 others take every block but the last from its
    prefix cache (whether they park or arrive after it is published), as the gauge shows."""
    bs = EngineConfig.__dataclass_fields__["block_size"].default
    prompt = f"{uuid.uuid4().hex} " + " ".join(f"word{i}" for i in range(80))  # never seen
    before = {rid: s["prefix_hit_tokens"] for rid, s in cluster.routing_stats().items()}
    r = client(cluster).completions.create(
        model=cluster.base, prompt=prompt, max_tokens=2, temperature=0, n=4
    )
    gains = {
        rid: s["prefix_hit_tokens"] - before[rid] for rid, s in cluster.routing_stats().items()
    }
    taken = (r.usage.prompt_tokens - 1) // bs * bs
    assert taken >= 2 * bs and sorted(gains.values()) == [0, 3 * taken], (gains, taken)
    # the same number reaches Ray's metrics (Prometheus, exported every 0.5 s)
    wait_for(
        lambda: max(cluster.gauge("prefix_hit_tokens").values(), default=0.0) >= 3 * taken,
        10,
        f"a prefix_hit_tokens gauge to reach {3 * taken}",
        interval_s=0.5,
    )


AUTH = [  # key, model, expected status
    (None, "demo-poet", 401),
    ("bad", "demo-poet", 401),
    ("t1", "demo-poet", 200),
    ("t1", "t1-private", 200),
    ("t2", "t1-private", 404),
    ("t1", "extra-0", 404),
    ("t2", "extra-0", 200),
    ("ops", "extra-0", 200),
    ("ops", "t1-private", 200),
    ("t1", "no-such-adapter", 404),
    ("t1", "BASE", 200),
    (None, "BASE", 401),
]


@pytest.mark.parametrize("key, model, status", AUTH)
def test_auth_matrix(cluster, key, model, status):
    headers = {}
    if key is not None:
        headers["Authorization"] = f"Bearer {cluster.keys.get(key, 'lf-not-a-key')}"
    model = cluster.base if model == "BASE" else model
    r = httpx.post(
        f"{cluster.http}/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0},
        headers=headers,
        timeout=60,
    )
    assert r.status_code == status, r.text
    if status != 200:
        err = r.json()["error"]
        assert err["type"] == {401: "authentication_error", 404: "invalid_request_error"}[status]
    if status == 404:
        assert r.json()["error"]["message"] == f"adapter {model!r} not found"


def test_models_lists_what_each_tenant_may_use(cluster):
    def ids(key):
        return [m.id for m in client(cluster, key).models.list()]

    public = ["demo-chef", "demo-coder", "demo-poet", "extra-1", "extra-2", "extra-3"]
    assert ids("t1") == [cluster.base, *sorted(public + ["t1-private"])]
    assert ids("t2") == [cluster.base, *sorted(public + ["extra-0"])]
    models = client(cluster, "t2").models.list().data
    assert {m.parent for m in models[1:]} == {cluster.base}


@pytest.mark.parametrize(
    "body",
    [
        {"model": "demo-poet", "prompt": PROMPT, "max_tokens": -1},
        {"model": "demo-poet", "prompt": PROMPT, "temperature": "hot"},
        {"model": "demo-poet", "prompt": [999999]},
        {"model": "demo-poet", "prompt": PROMPT, "max_tokens": 100000},
        {"prompt": PROMPT},
    ],
)
def test_bad_input_is_400_never_500(cluster, body):
    r = httpx.post(
        f"{cluster.http}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {cluster.keys['ops']}"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_adapters_that_cannot_serve_are_refused_not_500(cluster, tmp_path):
    reg = cluster.registry()
    assert reg.get_served().model_id == cluster.base  # the ingress published it
    names = reg.list_adapter_names()
    paths = misfit_adapters(cluster, tmp_path)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for name, path, code in [
        ("wide", paths["wide"], "adapter_incompatible"),
        ("nan", paths["nan"], "adapter_incompatible"),
        (cluster.base, str(cluster.adapters["extra-1"]), "invalid_request"),
    ]:
        body = {"lora_name": name, "lora_path": path, "public": True}
        r = httpx.post(f"{cluster.http}/v1/load_lora_adapter", json=body, headers=admin, timeout=30)
        assert (r.status_code, r.json()["error"]["code"]) == (400, code), r.text
    assert reg.list_adapter_names() == names
    # Registered past the check (a registry client that knows no base): the replica's own
    # validation refuses it, and its error reaches the client as the same 400, not a 500.
    reg.register_adapter("sneaky-wide", paths["wide"], public=True)
    with pytest.raises(openai.BadRequestError, match="do not fit the base model"):
        complete(cluster, "sneaky-wide")
    assert reg.unregister_adapter("sneaky-wide") in ("draining", "removed")
    reg.close()


def test_admin_endpoints(cluster, tmp_path):
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    path = str(cluster.adapters["extra-1"])
    body = {"lora_name": "late-tenant", "lora_path": path, "public": True}
    r = httpx.post(f"{cluster.http}/v1/load_lora_adapter", json=body, timeout=30)
    assert r.status_code == 401
    r = httpx.post(f"{cluster.http}/v1/load_lora_adapter", json=body, headers=admin, timeout=30)
    # its config names no other base model: no warning
    assert r.status_code == 200 and (r.json()["version"], r.json().get("warning")) == (1, None)
    assert (
        complete(cluster, "late-tenant").choices[0].text
        == complete(cluster, "extra-1").choices[0].text
    )
    r = httpx.post(
        f"{cluster.http}/v1/pin_lora_adapter", json={"lora_name": "late-tenant"}, headers=admin
    )
    assert r.status_code == 200
    reg = cluster.registry()
    assert reg.desired_state().pins == {"late-tenant": "all"}
    # max_loras 2: a second pin would leave the replicas no evictable slot
    r = httpx.post(
        f"{cluster.http}/v1/pin_lora_adapter", json={"lora_name": "extra-1"}, headers=admin
    )
    assert r.status_code == 409 and r.json()["error"]["code"] == "pin_refused", r.text
    assert "2 slots (max_loras) and 1 pinned already (late-tenant)" in r.json()["error"]["message"]
    assert reg.desired_state().pins == {"late-tenant": "all"}
    r = httpx.post(
        f"{cluster.http}/v1/unpin_lora_adapter", json={"lora_name": "late-tenant"}, headers=admin
    )
    assert r.json()["was_pinned"] is True and reg.desired_state().pins == {}, r.text
    r = httpx.post(
        f"{cluster.http}/v1/unload_lora_adapter", json={"lora_name": "late-tenant"}, headers=admin
    )
    assert r.status_code == 200 and r.json()["state"] in ("draining", "removed")
    reg.close()
    with pytest.raises(openai.NotFoundError):  # draining or removed: the same 404
        complete(cluster, "late-tenant")
    # an adapter whose config names another base model: registered (shapes fit), with a warning
    other = Path(shutil.copytree(path, tmp_path / "other")) / "adapter_config.json"
    other.write_text(
        json.dumps({**json.loads(other.read_text()), "base_model_name_or_path": "o/m"})
    )
    body = {"lora_name": "other-base", "lora_path": str(other.parent)}
    r = httpx.post(f"{cluster.http}/v1/load_lora_adapter", json=body, headers=admin, timeout=30)
    assert r.json()["warning"].startswith(
        f"the adapter's config names base model 'o/m'; this cluster serves {cluster.base!r}"
    ), r.text


def test_grpc_stream_equals_rest(cluster):
    stub = cluster.grpc_stub()
    for model in ["demo-poet", "extra-2", cluster.base]:
        req = pb.GenerateRequest(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        chunks = list(stub.Generate(req, metadata=cluster.grpc_auth()))
        assert "".join(c.text for c in chunks) == complete(cluster, model).choices[0].text
        assert chunks[-1].finish_reason == "length"
        assert all(c.finish_reason == "" for c in chunks[:-1])
        assert sum(len(c.token_ids) for c in chunks) == MAX_TOKENS
    names = [
        m.id
        for m in stub.ListModels(pb.ListModelsRequest(), metadata=cluster.grpc_auth("t2")).models
    ]
    assert names[0] == cluster.base and "extra-0" in names and "t1-private" not in names


@pytest.mark.parametrize(
    "model, key, code",
    [
        ("no-such-adapter", "ops", grpc.StatusCode.NOT_FOUND),
        ("t1-private", "t2", grpc.StatusCode.NOT_FOUND),
        ("demo-poet", None, grpc.StatusCode.UNAUTHENTICATED),
        ("", "ops", grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_grpc_status_codes_mirror_rest(cluster, model, key, code):
    meta = cluster.grpc_auth(key) if key else ()
    req = pb.GenerateRequest(model=model, prompt=PROMPT, max_tokens=2)
    with pytest.raises(grpc.RpcError) as e:
        list(cluster.grpc_stub().Generate(req, metadata=meta))
    assert e.value.code() == code


def test_revoked_key_is_refused_on_rest_and_grpc(cluster):
    reg = cluster.registry()
    key = reg.issue_api_key("t1")
    body = {"model": "demo-poet", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}"}
    r = httpx.post(f"{cluster.http}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    reg.revoke_api_key("t1", key_id(hash_key(key)))
    reg.close()
    r = httpx.post(f"{cluster.http}/v1/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 401, r.text
    req = pb.GenerateRequest(model="demo-poet", prompt=PROMPT, max_tokens=2)
    with pytest.raises(grpc.RpcError) as e:
        list(cluster.grpc_stub().Generate(req, metadata=(("authorization", f"Bearer {key}"),)))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def _running(cluster) -> int:
    return sum(s["queue_len"] for s in cluster.routing_stats().values())


def test_grpc_cancel_aborts_in_the_engine(cluster):
    stub = cluster.grpc_stub()
    req = pb.GenerateRequest(model="demo-coder", prompt=PROMPT, max_tokens=400, temperature=0)
    call = stub.Generate(req, metadata=cluster.grpc_auth())
    it = iter(call)
    next(it), next(it)
    assert _running(cluster) == 1
    call.cancel()
    wait_for(lambda: _running(cluster) == 0, 10, "the cancelled request to leave the engine", 0.1)


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
