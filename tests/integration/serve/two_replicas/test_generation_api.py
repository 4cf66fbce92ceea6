"""End-to-end generation on the two-replica cluster: the OpenAI client, httpx and a gRPC
client; greedy outputs equal an in-process offline `LLMEngine`'s on the same model and
adapter directories; LoRA-affinity routing, shared prompts, metrics, cancellation.
Killing replicas is in test_replica_failure.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import openai
import pytest

from replica.config import EngineConfig
from router.proto import lorafleet_pb2 as pb
from tests.integration.serve.cluster_fixture import (
    assert_offsets_match,
    gpu_holders,
    total_loads,
)
from tests.integration.serve.two_replicas.calls import MAX_TOKENS, PROMPT, client, complete
from tests.polling import wait_for

pytestmark = pytest.mark.integration


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
