"""The sampling API beyond one plain greedy choice, end to end (the OpenAI client, raw
SSE and gRPC against one real cluster).

`n` choices: greedy choices equal one greedy answer, seeded choice i equals a single
request with seed + i and the response repeats, a stream of n choices reassembles to the
whole response with one usage chunk and one [DONE], and a client that leaves a stream
aborts every choice in the engine, and with echo and logprobs every choice echoes the
prompt scores of n = 1, computed once. Penalties and logit_bias: REST and gRPC answer what
an offline engine with the same SamplingParams generates.

One app with one replica, shared with this package's other modules (conftest.py).
"""

from __future__ import annotations

import json
import uuid

import grpc
import httpx
import openai
import pytest

from replica.sampling_params import SamplingParams
from router.choices import MAX_N, N_ALLOWED
from router.proto import lorafleet_pb2 as pb
from router.proto import lorafleet_pb2_grpc as pb_grpc
from tests.hf_reference import hf_logp
from tests.integration.serve.cluster_fixture import offline_texts
from tests.polling import wait_for

pytestmark = pytest.mark.integration
PROMPT = "hello world how are"
MESSAGES = [{"role": "user", "content": "what is lorafleet"}]
MAX_TOKENS = 8
SEED = 1234
INT64_MAX = 2**63 - 1
KINDS = ["completions", "chat"]


def create(cluster, kind: str, model: str = "demo-poet", **kw):
    c = openai.OpenAI(
        base_url=f"{cluster.http}/v1", api_key=cluster.keys["ops"], max_retries=0, timeout=60
    )
    kw.setdefault("max_tokens", MAX_TOKENS)
    if kind == "completions":
        return c.completions.create(model=model, prompt=PROMPT, **kw)
    return c.chat.completions.create(model=model, messages=MESSAGES, **kw)


def texts(r) -> list[str]:
    return [c.text if hasattr(c, "text") else c.message.content for c in r.choices]


def logprob_tokens(r) -> list[list[str]]:
    if hasattr(r.choices[0], "text"):
        return [c.logprobs.tokens for c in r.choices]
    return [[t.token for t in c.logprobs.content] for c in r.choices]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("model", ["BASE", "demo-poet"])
def test_greedy_choices_all_equal_one_greedy_answer(cluster, kind, model):
    model = cluster.base if model == "BASE" else model
    logprobs = {"logprobs": 1} if kind == "completions" else {"logprobs": True}
    one = create(cluster, kind, model, temperature=0, **logprobs)
    r = create(cluster, kind, model, temperature=0, n=3, **logprobs)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert texts(r) == texts(one) * 3
    assert [c.finish_reason for c in r.choices] == [one.choices[0].finish_reason] * 3
    assert logprob_tokens(r) == logprob_tokens(one) * 3
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.parametrize("kind", KINDS)
def test_seeded_choice_i_is_the_answer_of_seed_plus_i_and_repeats(cluster, kind):
    r = create(cluster, kind, n=3, seed=SEED, temperature=1.0)
    singles = [create(cluster, kind, seed=SEED + i, temperature=1.0) for i in range(3)]
    assert texts(r) == [texts(s)[0] for s in singles]
    assert len(set(texts(r))) > 1, texts(r)  # the choices are different samples
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert texts(create(cluster, kind, n=3, seed=SEED, temperature=1.0)) == texts(r)


def test_seeds_wrap_at_the_end_of_the_int64_range(cluster):
    r = create(cluster, "completions", n=2, seed=INT64_MAX, temperature=1.0)
    wrapped = create(cluster, "completions", seed=-(2**63), temperature=1.0)
    assert texts(r)[1] == texts(wrapped)[0]


def sse_events(cluster, path: str, body: dict) -> list:
    """The data of every SSE event of a streamed POST (JSON-decoded but "[DONE]")."""
    headers = {"Authorization": f"Bearer {cluster.keys['ops']}"}
    with httpx.stream("POST", f"{cluster.http}{path}", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        datas = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    return [d if d == "[DONE]" else json.loads(d) for d in datas]


@pytest.mark.parametrize("kind", KINDS)
def test_a_stream_of_two_choices_reassembles_to_the_whole_response(cluster, kind):
    fields = {"n": 2, "seed": SEED, "temperature": 1.0}
    whole = create(cluster, kind, **fields)
    body = {"model": "demo-poet", "max_tokens": MAX_TOKENS, **fields, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if kind == "completions":
        events = sse_events(cluster, "/v1/completions", {**body, "prompt": PROMPT})
    else:
        events = sse_events(cluster, "/v1/chat/completions", {**body, "messages": MESSAGES})
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    usage = [c for c in chunks if c.get("usage")]
    assert usage == [chunks[-1]] and usage[0]["choices"] == []
    u = whole.usage
    assert usage[0]["usage"] == {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
    }
    parts, finish = {0: [], 1: []}, {0: [], 1: []}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        text = choice["text"] if kind == "completions" else choice["delta"].get("content")
        parts[choice["index"]].append(text or "")
        finish[choice["index"]].append(choice["finish_reason"])
    assert ["".join(parts[i]) for i in (0, 1)] == texts(whole)
    for i in (0, 1):  # only each choice's last chunk has its finish_reason
        assert finish[i][-1] == whole.choices[i].finish_reason
        assert set(finish[i][:-1]) <= {None}


def _running(cluster) -> int:
    return sum(s["queue_len"] for s in cluster.routing_stats().values())


def test_a_client_leaving_a_stream_aborts_every_choice(cluster):
    body = {
        "model": "demo-coder",
        "prompt": PROMPT,
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0,
        "n": 3,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {cluster.keys['ops']}"}
    with httpx.stream(
        "POST", f"{cluster.http}/v1/completions", json=body, headers=headers, timeout=60
    ) as r:
        lines = r.iter_lines()
        assert [next(lines) for _ in range(2)][0].startswith("data: ")
        assert _running(cluster) == 3
    wait_for(lambda: _running(cluster) == 0, 10, "the 3 choices leaving the engine", 0.2)


@pytest.mark.parametrize("n", [0, MAX_N + 1, "2", True])
def test_a_bad_n_is_400_naming_n(cluster, n):
    headers = {"Authorization": f"Bearer {cluster.keys['ops']}"}
    body = {"model": "demo-poet", "prompt": PROMPT, "n": n}
    r = httpx.post(f"{cluster.http}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "n"
    if isinstance(n, int) and not isinstance(n, bool):
        assert err["message"] == f"n: {n}; {N_ALLOWED}"
    else:
        assert err["message"].startswith("n: got ") and err["message"].endswith(
            "allowed: an integer"
        )


PENALTIES = dict(
    presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.5, logit_bias={17: 4.0}
)


def test_penalties_on_rest_and_grpc_equal_offline(cluster):
    """The OpenAI client's own fields (vLLM's extensions in extra_body) and their gRPC
    twins reach the engine: both answer what an offline engine with the same
    SamplingParams generates, which differs from plain greedy."""
    fields = {k: v for k, v in PENALTIES.items() if k != "logit_bias"}
    models = ["demo-poet", cluster.base]
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    greedy = offline_texts(cluster, PROMPT, plain, models)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **PENALTIES)
    want = offline_texts(cluster, PROMPT, params, models)
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(cluster.grpc))
    meta = (("authorization", f"Bearer {cluster.keys['ops']}"),)
    for model in models:
        assert want[model] != greedy[model], model
        rest = create(
            cluster,
            "completions",
            model,
            temperature=0,
            presence_penalty=fields["presence_penalty"],
            frequency_penalty=fields["frequency_penalty"],
            logit_bias={"17": 4.0},
            extra_body={"repetition_penalty": 1.5, "top_k": -1},
        )
        assert rest.choices[0].text == want[model], model
        req = pb.GenerateRequest(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, logit_bias={17: 4.0}, **fields
        )
        chunks = list(stub.Generate(req, metadata=meta))
        assert "".join(c.text for c in chunks) == want[model], model


def test_grpc_choices_equal_the_rest_choices(cluster):
    """gRPC's n: chunks of the choices interleave, each naming its choice, and choice i is
    REST's choice i of the same seeded request; a bad n is INVALID_ARGUMENT naming n."""
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(cluster.grpc))
    meta = (("authorization", f"Bearer {cluster.keys['ops']}"),)
    rest = create(cluster, "completions", n=3, seed=SEED, temperature=1.0)
    req = pb.GenerateRequest(
        model="demo-poet", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, seed=SEED, n=3
    )
    chunks = list(stub.Generate(req, metadata=meta))
    assert ["".join(c.text for c in chunks if c.index == i) for i in range(3)] == texts(rest)
    assert sorted(c.index for c in chunks if c.finish_reason) == [0, 1, 2]
    assert {c.index for c in chunks} == {0, 1, 2}
    bad = pb.GenerateRequest(model="demo-poet", prompt=PROMPT, n=MAX_N + 1)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(bad, metadata=meta))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == f"n: {MAX_N + 1}; {N_ALLOWED}"


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_scores_the_prompt_as_hf_peft_does(cluster, max_tokens):
    """lm-evaluation-harness' log-likelihood request (echo, logprobs 1, max_tokens 0 or
    more, token ids or text) through the OpenAI client: the prompt's logprobs equal an HF +
    PEFT forward's, the first null; the prompt comes back before the completion, which
    equals the answer without echo."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(cluster.demo.model_dir))
    ids = tok(PROMPT).input_ids
    logp = hf_logp(cluster.demo.model_dir, cluster.adapters["demo-poet"], ids)[:-1]
    plain = create(cluster, "completions", temperature=0, max_tokens=max(max_tokens, 1))
    for prompt in (PROMPT, ids):
        c = openai.OpenAI(
            base_url=f"{cluster.http}/v1", api_key=cluster.keys["ops"], max_retries=0, timeout=60
        )
        r = c.completions.create(
            model="demo-poet", prompt=prompt, echo=True, logprobs=1, max_tokens=max_tokens,
            temperature=0,
        )  # fmt: skip
        (choice,) = r.choices
        generated = plain.choices[0].text if max_tokens else ""
        assert choice.text == tok.decode(ids, skip_special_tokens=True) + generated
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = logp[torch.arange(len(ids) - 1), ids[1:]].tolist()
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=1e-4)
        assert len(lp.tokens) == len(ids) + r.usage.completion_tokens
        assert r.usage.completion_tokens == (max_tokens and plain.usage.completion_tokens)
        assert lp.text_offset[0] == 0
        if max_tokens == 0:
            assert choice.finish_reason == "length"


def test_tenants_share_no_prefix_blocks_unless_they_share_a_salt(cluster):
    """auth on, prefix_cache_scope "tenant" (the default): a tenant's second request with a
    long prompt takes its own blocks from the prefix cache, another tenant's takes none;
    a request cache_salt separates one tenant's requests too (REST and gRPC)."""
    prompt = "the same long system prompt " * 12

    def hits() -> int:
        return sum(s["prefix_hit_tokens"] for s in cluster.routing_stats().values())

    def ask(tenant: str, **extra) -> None:
        r = httpx.post(
            f"{cluster.http}/v1/completions",
            json={"model": "demo-poet", "prompt": prompt, "max_tokens": 1, **extra},
            headers={"Authorization": f"Bearer {cluster.keys[tenant]}"},
            timeout=60,
        )
        assert r.status_code == 200, r.text

    ask("ops")
    before = hits()
    ask("t2")  # another tenant: nothing reused
    assert hits() == before
    ask("ops", cache_salt="user-1")  # the same tenant under its own salt: nothing either
    assert hits() == before
    ask("ops")
    assert hits() > before  # the same tenant, no salt: its blocks are reused
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(cluster.grpc))
    meta = (("authorization", f"Bearer {cluster.keys['ops']}"),)
    again = hits()
    req = pb.GenerateRequest(model="demo-poet", prompt=prompt, max_tokens=1, cache_salt="user-1")
    list(stub.Generate(req, metadata=meta))
    assert hits() > again  # the salted ops request's blocks, reused over gRPC


def test_min_tokens_and_stop_token_ids_on_rest_and_grpc_equal_offline(cluster):
    """vLLM's min_tokens and stop_token_ids (extra_body of the OpenAI client, and gRPC
    fields 16 and 17) reach the engine: both answer what an offline engine with the same
    SamplingParams generates, which differs from the answer without min_tokens."""
    from tests.integration.serve.cluster_fixture import offline_outputs

    free = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    _, plain = offline_outputs(cluster, PROMPT, free, ["demo-poet"])["demo-poet"]
    stops = (plain[1],)  # greedy's second token ends the answer there without min_tokens
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=stops)
    early = offline_texts(cluster, PROMPT, params, ["demo-poet"])["demo-poet"]
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=stops, min_tokens=4
    )
    want = offline_texts(cluster, PROMPT, params, ["demo-poet"])["demo-poet"]
    assert want != early
    rest = create(
        cluster, "completions", temperature=0,
        extra_body={"min_tokens": 4, "stop_token_ids": list(stops)},
    )  # fmt: skip
    assert rest.choices[0].text == want
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(cluster.grpc))
    meta = (("authorization", f"Bearer {cluster.keys['ops']}"),)
    req = pb.GenerateRequest(
        model="demo-poet", prompt=PROMPT, max_tokens=MAX_TOKENS, min_tokens=4,
        stop_token_ids=list(stops),
    )  # fmt: skip
    assert "".join(c.text for c in stub.Generate(req, metadata=meta)) == want


def test_grpc_logprobs_equal_the_rest_logprobs(cluster):
    """GenerateRequest.logprobs k (field 18): each chunk carries one TokenLogprob per token
    id, equal (to float32) to REST's token_logprobs and top_logprobs for the same tokens."""
    rest = create(cluster, "completions", temperature=0, logprobs=2)
    lp = rest.choices[0].logprobs
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(cluster.grpc))
    meta = (("authorization", f"Bearer {cluster.keys['ops']}"),)
    req = pb.GenerateRequest(model="demo-poet", prompt=PROMPT, max_tokens=MAX_TOKENS, logprobs=2)
    chunks = list(stub.Generate(req, metadata=meta))
    got = [t for c in chunks for t in c.logprobs]
    assert len(got) == sum(len(c.token_ids) for c in chunks) == len(lp.tokens)
    assert [t.logprob for t in got] == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert [len(t.top) for t in got] == [2] * len(got)
    for t, top in zip(got, lp.top_logprobs, strict=True):  # greedy: the sampled is the top one
        want = sorted(top.values())[-2:]
        assert sorted(x.logprob for x in t.top) == pytest.approx(want, abs=1e-6)


def test_a_batch_of_token_id_prompts_scores_each_as_alone(cluster):
    """lm-evaluation-harness' local-completions payload: a batch of token-id prompts with
    echo, logprobs 1 and max_tokens 0. Choice i scores prompt i exactly as the same
    request with that prompt alone."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(cluster.demo.model_dir))
    batch = [tok(p).input_ids for p in (PROMPT, "what is lorafleet", "a")]
    body = {"model": "demo-poet", "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    headers = {"Authorization": f"Bearer {cluster.keys['ops']}"}

    def post_body(prompt) -> dict:
        r = httpx.post(
            f"{cluster.http}/v1/completions", json={**body, "prompt": prompt}, headers=headers,
            timeout=60,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()

    together = post_body(batch)
    assert [c["index"] for c in together["choices"]] == [0, 1, 2]
    for ids, choice in zip(batch, together["choices"], strict=True):
        alone = post_body(ids)["choices"][0]
        assert choice["text"] == alone["text"]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(
            alone["logprobs"]["token_logprobs"], abs=1e-5
        )
        assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert together["usage"]["prompt_tokens"] == sum(map(len, batch))


@pytest.mark.parametrize("prompt_kind, max_tokens, n, k", [("text", 0, 1, 2), ("ids", 3, 2, 1)])
def test_grpc_prompt_logprobs_equal_the_rest_echo_logprobs(cluster, prompt_kind, max_tokens, n, k):
    """GenerateRequest.prompt_logprobs k (field 19): each choice's first chunk carries the
    prompt's ids and one TokenLogprob per prompt token after the first, equal (to float32)
    to REST's echo logprobs of the same request; max_tokens 0 then scores the prompt only
    (one chunk per choice), and is refused without prompt_logprobs as REST refuses it
    without echo."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(cluster.demo.model_dir))(PROMPT).input_ids
    prompt = {"prompt": PROMPT} if prompt_kind == "text" else {"prompt_token_ids": ids}
    rest = create(
        cluster, "completions", temperature=0, max_tokens=max_tokens, n=n, echo=True, logprobs=k
    ).choices
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(cluster.grpc))
    meta = (("authorization", f"Bearer {cluster.keys['ops']}"),)
    generated = {"logprobs": k} if max_tokens else {}
    req = pb.GenerateRequest(
        model="demo-poet", max_tokens=max_tokens, n=n, prompt_logprobs=k, **prompt, **generated
    )
    chunks = list(stub.Generate(req, metadata=meta))
    for i in range(n):
        mine = [c for c in chunks if c.index == i]
        assert list(mine[0].prompt_token_ids) == ids
        assert all(not c.prompt_token_ids and not c.prompt_logprobs for c in mine[1:])
        scores = list(mine[0].prompt_logprobs) + [t for c in mine for t in c.logprobs]
        lp = rest[i].logprobs
        assert len(mine[0].prompt_logprobs) == len(ids) - 1
        assert len(scores) == len(lp.token_logprobs) - 1
        assert [t.logprob for t in scores] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
        for t, top in zip(scores, lp.top_logprobs[1:], strict=True):
            assert len(t.top) == k
            want = sorted(top.values(), reverse=True)[:k]  # REST's adds the token's own
            assert [x.logprob for x in t.top] == pytest.approx(want, abs=1e-5)
        assert "".join(c.text for c in mine) == rest[i].text.removeprefix(PROMPT)
        assert mine[-1].finish_reason == rest[i].finish_reason
        assert len(mine) == 1 or max_tokens
    bad = pb.GenerateRequest(model="demo-poet", max_tokens=0, **prompt)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(bad, metadata=meta))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == (
        "max_tokens: got 0; allowed: an integer >= 1, or 0 with prompt_logprobs set (the "
        "prompt only, e.g. to score it with logprobs)"
    )


@pytest.mark.parametrize("stream", [False, True])
def test_n_echo_choices_each_echo_the_n_1_scores_and_the_prompt_is_computed_once(cluster, stream):
    """n = 3 with echo and logprobs: every choice equals the same request with n = 1 (the
    echoed prompt's scores exactly: one choice scores it, all echo its scores), and the
    replica computed the prompt once. The two other choices take every full block but the
    one holding the last token from the prefix cache, as its counters show (before: each
    choice scored the prompt itself, 3 x its tokens computed and no block taken)."""
    from replica.config import EngineConfig
    from tests.unit.router.test_rest_echo import by_index

    bs = EngineConfig.__dataclass_fields__["block_size"].default
    prompt = f"{uuid.uuid4().hex} " + " ".join(f"word{i}" for i in range(60))  # never seen
    body = {"model": "demo-poet", "prompt": prompt, "echo": True, "logprobs": 2,
            "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": stream}  # fmt: skip
    headers = {"Authorization": f"Bearer {cluster.keys['ops']}"}

    def post(n: int) -> dict[int, dict]:
        if stream:
            events = sse_events(cluster, "/v1/completions", {**body, "n": n})
            return by_index(events[:-1], True)
        r = httpx.post(
            f"{cluster.http}/v1/completions", json={**body, "n": n}, headers=headers, timeout=60
        )  # fmt: skip
        assert r.status_code == 200, r.text
        return by_index(r.json(), False)

    def counts() -> tuple[int, int]:
        (stats,) = cluster.routing_stats().values()  # one replica
        return stats["computed_tokens"], stats["prefix_hit_tokens"]

    computed, hits = counts()
    many = post(3)
    after = counts()
    computed, hits = after[0] - computed, after[1] - hits
    one = post(1)[0]
    p = len(one["logprobs"]["tokens"]) - 4
    taken = (p - 1) // bs * bs
    assert taken >= 2 * bs
    assert (computed, hits) == (p + 2 * (p - taken) + 3 * 3, 2 * taken)
    assert set(many) == {0, 1, 2}
    for choice in many.values():
        assert choice["text"] == one["text"]
        lp, want = choice["logprobs"], one["logprobs"]
        assert lp["tokens"] == want["tokens"] and lp["text_offset"] == want["text_offset"]
        assert lp["token_logprobs"][:p] == want["token_logprobs"][:p]
        assert lp["top_logprobs"][:p] == want["top_logprobs"][:p]
        assert lp["token_logprobs"][p:] == pytest.approx(want["token_logprobs"][p:], abs=1e-5)
    # ray_lorafleet_computed_tokens shows the replica's count (metrics lag the engine)
    wait_for(
        lambda: (
            cluster.gauge("computed_tokens")
            == {rid: float(s["computed_tokens"]) for rid, s in cluster.routing_stats().items()}
        ),
        10,
        "the computed_tokens gauges to read each replica's own count",
        interval_s=0.5,
    )
