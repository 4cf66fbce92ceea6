"""Request validation end to end: REST and gRPC refuse the same user errors with 400 /
INVALID_ARGUMENT naming the field, answer a bad key with one message, and answer a new
request for an adapter being unloaded exactly like one for an unknown adapter while the
in-flight request finishes.

One module-scoped app with one replica (see cluster_fixture.py).
"""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest

from router.auth import INVALID_KEY
from router.choices import PROMPT_ALLOWED
from router.openai_responses import model_card
from router.proto import lorafleet_pb2 as pb
from router.proto import lorafleet_pb2_grpc as pb_grpc
from tests.integration.serve.cluster_fixture import ADMIN_KEY, start_cluster, stop_cluster
from tests.polling import wait_for

pytestmark = pytest.mark.integration
PROMPT = "hello world how are"
INT64 = "-9223372036854775808 .. 9223372036854775807"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("cluster"), num_replicas=1)
    yield c
    stop_cluster(c)


def post(cluster, path, body, key="ops"):
    token = ADMIN_KEY if key == "admin" else cluster.keys.get(key, "lf-not-a-key")
    headers = {"Authorization": f"Bearer {token}"}
    return httpx.post(f"{cluster.http}{path}", json=body, headers=headers, timeout=60)


def grpc_generate(cluster, key="ops", **fields) -> list[pb.GenerateChunk]:
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(cluster.grpc))
    token = cluster.keys.get(key, "lf-not-a-key")
    req = pb.GenerateRequest(prompt=PROMPT, max_tokens=2, **fields)
    return list(stub.Generate(req, metadata=(("authorization", f"Bearer {token}"),)))


def completion(**fields) -> dict:
    return {"model": "demo-poet", "prompt": PROMPT, "max_tokens": 2, **fields}


@pytest.mark.parametrize(
    "body, message",
    [
        (completion(seed=2**64), f"seed={2**64}; allowed: null or an integer in {INT64}"),
        (completion(seed=-(2**63) - 1, stream=True), "seed=-9223372036854775809; allowed"),
        (completion(seed=2**70, stream=True), "seed=1180591620717411303424; allowed"),
        (completion(temperature=5), "temperature=5.0; allowed: 0 <= temperature <= 2"),
        (completion(max_tokens=True), "max_tokens: got a boolean (true); allowed: an integer"),
        (completion(best_of=2), "best_of: 2 with n = 1; allowed: null or 1"),
        (completion(suffix="tail"), "suffix: "),
        (completion(stream_options={"include_usage": True}), "stream_options: allowed only"),
        (completion(prompt=["a", [1]]), f"prompt: {PROMPT_ALLOWED}"),
    ],
)
def test_rest_user_errors_are_400_naming_the_field(cluster, body, message):
    r = post(cluster, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_request")
    assert err["message"].startswith(message)
    assert err["param"] == message.split(":")[0].split("=")[0]


def post_raw(cluster, path: str, content: bytes, key="ops") -> httpx.Response:
    token = cluster.keys.get(key, "lf-not-a-key")
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    return httpx.post(f"{cluster.http}{path}", content=content, headers=headers, timeout=60)


LONE = b'"\\ud800"'  # the JSON escape of a lone surrogate
CHAT = b'{"model":"demo-poet","max_tokens":2,"messages":[{"role":"user","content":%s}]}'


@pytest.mark.parametrize(
    "path, content, param",
    [
        ("/v1/completions", b'{"model":"demo-poet","prompt":%s,"max_tokens":2}' % LONE, "prompt"),
        (
            "/v1/completions",
            b'{"model":"demo-poet","prompt":%s,"max_tokens":2,"stream":true}' % LONE,
            "prompt",
        ),
        ("/v1/chat/completions", CHAT % LONE, "messages.0.content"),
        ("/v1/completions", b'{"model":"demo-poet","prompt":"a","stop":[%s]}' % LONE, "stop.0"),
    ],
)
def test_strings_that_are_not_unicode_text_are_400(cluster, path, content, param):
    r = post_raw(cluster, path, content)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert err["message"].startswith(f"{param}: not valid Unicode text (lone surrogate \\ud800")


@pytest.mark.parametrize(
    "path, content",
    [
        ("/v1/completions", b'{"model":"demo-poet","prompt":"a","max_tokens":"x"}'),
        ("/v1/completions", b"{not json"),
        ("/v1/chat/completions", b'{"model":"demo-poet","messages":[]}'),
        ("/v1/completions", b'{"model":"demo-poet","prompt":"a","logit_bias":{"a":5}}'),
    ],
)
def test_a_bad_key_is_401_before_the_body_is_judged(cluster, path, content):
    r = post_raw(cluster, path, content, key="bad")
    assert (r.status_code, r.json()["error"]["message"]) == (401, INVALID_KEY)
    assert post_raw(cluster, path, content).status_code == 400


def test_grpc_checks_the_key_before_the_request(cluster):
    with pytest.raises(grpc.RpcError) as e:
        grpc_generate(cluster, key="bad", model="demo-poet", temperature=5.0)
    assert (e.value.code(), e.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, INVALID_KEY)


@pytest.mark.parametrize(
    "method, path, status, code",
    [
        ("GET", "/v1/nope", 404, "not_found"),
        ("GET", "/v1/completions", 405, "method_not_allowed"),
        ("GET", "/openapi.json", 404, "not_found"),  # it would list the admin endpoints
        ("GET", "/docs", 404, "not_found"),
    ],
)
def test_bad_routes_answer_in_the_openai_shape(cluster, method, path, status, code):
    r = httpx.request(method, f"{cluster.http}{path}", timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", None, code)


def test_unsupported_fields_are_refused_unless_neutral(cluster):
    chat = {"model": "demo-poet", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = post(cluster, "/v1/chat/completions", {**chat, "response_format": {"type": "xml"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    neutral = {"response_format": {"type": "text"}, "tools": [], "presence_penalty": 0}
    assert post(cluster, "/v1/chat/completions", {**chat, **neutral}).status_code == 200
    # vLLM's fields that change the output: ignoring them would answer as if not sent
    for path, body, field in [
        ("/v1/completions", completion(use_beam_search=True, stream=True), "use_beam_search"),
        ("/v1/chat/completions", {**chat, "bad_words": ["hi"]}, "bad_words"),
    ]:
        r = post(cluster, path, body)
        assert (r.status_code, r.json()["error"]["param"]) == (400, field), r.text
    neutral = {"min_p": 0, "use_beam_search": False, "guided_json": None}
    assert post(cluster, "/v1/chat/completions", {**chat, **neutral}).status_code == 200


def test_chat_max_tokens_defaults_to_the_room_left(cluster):
    # the demo tokenizer spells "a" as one token; its chat template adds 3 (context 1024)
    body = {"model": "demo-poet", "messages": [{"role": "user", "content": "a" * 1019}]}
    r = post(cluster, "/v1/chat/completions", {**body, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {
        "prompt_tokens": 1022,
        "completion_tokens": 2,
        "total_tokens": 1024,
    }


def test_null_fields_mean_their_default(cluster):
    nulls = dict.fromkeys(["max_tokens", "temperature", "seed", "stop", "stream_options"])
    r = post(cluster, "/v1/completions", completion(ignore_eos=True, **nulls))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "again"},
    ]
    body = {"model": "demo-poet", "messages": messages, "max_tokens": None, "ignore_eos": True}
    r = post(cluster, "/v1/chat/completions", {**body, "max_completion_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 5.0),
        ("top_p", 1.5),
        ("temperature", 2.01),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("repetition_penalty", 0.0),
        ("top_k", -2),
        ("logit_bias", {5: 100.5}),
    ],
)
def test_grpc_refuses_what_rest_refuses_with_the_same_message(cluster, field, value):
    sent = {str(k): v for k, v in value.items()} if isinstance(value, dict) else value
    rest = post(cluster, "/v1/completions", completion(**{field: sent}))
    assert rest.status_code == 400, rest.text
    with pytest.raises(grpc.RpcError) as e:
        grpc_generate(cluster, model="demo-poet", **{field: value})
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == rest.json()["error"]["message"]
    assert rest.json()["error"]["param"] == field


@pytest.mark.parametrize("stream", [False, True])
def test_a_biased_token_outside_the_vocabulary_is_refused_by_the_replica(cluster, stream):
    """The vocabulary is the model's: the replica's engine refuses the id, before any
    output, and both front doors answer it as a user error naming logit_bias."""
    vocab = 384  # the demo model's (deploy/demo.py)
    message = f"logit_bias: token id {vocab} out of range; allowed: token ids 0 <= id < {vocab}"
    body = completion(logit_bias={"3": 1, str(vocab): 1}, stream=stream)
    r = post(cluster, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["message"], r.json()["error"]["param"]) == (message, "logit_bias")
    with pytest.raises(grpc.RpcError) as e:
        grpc_generate(cluster, model="demo-poet", logit_bias={3: 1.0, vocab: 1.0})
    assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)


def test_a_bad_key_gets_one_message_everywhere(cluster):
    answers = [
        post(cluster, "/v1/completions", completion(model=cluster.base), key="bad"),
        post(cluster, "/v1/completions", completion(), key="bad"),
        post(cluster, "/v1/completions", completion(model="no-such-adapter"), key="bad"),
        httpx.get(
            f"{cluster.http}/v1/models", headers={"Authorization": "Bearer lf-bad"}, timeout=30
        ),
    ]
    assert [r.status_code for r in answers] == [401] * 4
    assert {r.json()["error"]["message"] for r in answers} == {INVALID_KEY}
    for model in (cluster.base, "demo-poet"):
        with pytest.raises(grpc.RpcError) as e:
            grpc_generate(cluster, key="bad", model=model)
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, INVALID_KEY)


def test_retrieve_a_model_answers_as_inference_does(cluster):
    """GET /v1/models/{model} (OpenAI's retrieve): the caller's card, or the inference
    routes' 404 for a forbidden adapter, byte for byte the one of an unknown name."""

    def retrieve(model, key="t1"):
        token = cluster.keys.get(key, "lf-not-a-key")
        url = f"{cluster.http}/v1/models/{model}"
        return httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    assert retrieve("t1-private").json() == model_card("t1-private", cluster.base, "lorafleet")
    assert retrieve(cluster.base, key="t2").json() == model_card(cluster.base, None, "lorafleet")
    forbidden, unknown = retrieve("t1-private", key="t2"), retrieve("no/such-adapter", key="t2")
    assert (forbidden.status_code, unknown.status_code) == (404, 404)
    assert forbidden.content == unknown.content.replace(b"no/such-adapter", b"t1-private")
    assert forbidden.content == post(cluster, "/v1/completions", completion(model="t1-private"),
                                     key="t2").content  # fmt: skip
    assert retrieve("demo-poet", key="bad").json()["error"]["message"] == INVALID_KEY
    health = httpx.get(f"{cluster.http}/health", timeout=30)  # vLLM's; no key needed
    assert (health.status_code, health.content) == (200, b"")


def test_warm_replicas_zero_clears_and_bounds_agree(cluster):
    warm = "/v1/warm_lora_adapter"
    r = post(cluster, warm, {"lora_name": "demo-chef", "replicas": 1}, key="admin")
    assert r.status_code == 200, r.text
    reg = cluster.registry()
    try:
        assert "demo-chef" in reg.desired_state().warm
        r = post(cluster, warm, {"lora_name": "demo-chef", "replicas": 0}, key="admin")
        assert r.status_code == 200 and r.json()["warm_replicas"] == 0, r.text
        assert "demo-chef" not in reg.desired_state().warm
    finally:
        reg.close()
    for body, message in [
        ({"lora_name": "demo-chef"}, "replicas: missing or null; this field is required"),
        (
            {"lora_name": "demo-chef", "replicas": "2"},
            "replicas: got a string; allowed: an integer",
        ),
        ({"lora_name": "demo-chef", "replicas": -1}, "replicas=-1; allowed: 0 .. 100000"),
        ({"lora_name": "demo-chef", "replicas": 10**9}, f"replicas={10**9}; allowed: 0 .. 100000"),
    ]:
        r = post(cluster, warm, body, key="admin")
        error = r.json()["error"]
        assert (r.status_code, error["message"], error["param"]) == (400, message, "replicas")
    body = {"lora_name": "x", "lora_path": "/nowhere", "public": "yes"}
    r = post(cluster, "/v1/load_lora_adapter", body, key="admin")
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "public: got a string; allowed: true or false"


BASE_ID = "<the base model's id>"
NAME_RULE = "allowed: 1-128 characters of letters, digits, '_', '.', '-', '/'"


@pytest.mark.parametrize(
    "fields, status, param, message",
    [
        (
            {"tenant": "nosuchtenant"},
            400,
            "tenant",
            "tenant 'nosuchtenant' does not exist; allowed: an existing tenant (create one "
            "with `lorafleet tenants create nosuchtenant`), or leave tenant out (no owner)",
        ),
        (
            {"lora_name": "bad name!"},
            400,
            "lora_name",
            f"lora_name: adapter name 'bad name!' is invalid; {NAME_RULE}",
        ),
        ({"tenant": "bad name"}, 400, "tenant", "tenant: tenant name 'bad name' is invalid"),
        ({"lora_path": "/nowhere"}, 422, "lora_path", "path='/nowhere' does not exist; allowed"),
        ({"lora_path": "/a\x00b"}, 400, "lora_path", "lora_path: contains a NUL character"),
        ({"base_model": "other"}, 400, "base_model", "base_model: 'other' is not the model"),
        ({"lora_name": "demo-poet"}, 409, "replace", "adapter 'demo-poet' already exists"),
        ({"lora_name": BASE_ID}, 400, "lora_name", "adapter name 'lorafleet-demo-base' is the"),
    ],
)
def test_load_refusals_name_the_field_at_fault(cluster, fields, status, param, message):
    if fields.get("lora_name") == BASE_ID:
        fields = {"lora_name": cluster.base}
    body = {"lora_name": "qa-new", "lora_path": str(cluster.adapters["extra-1"]), **fields}
    r = post(cluster, "/v1/load_lora_adapter", body, key="admin")
    assert (r.status_code, r.json()["error"]["param"]) == (status, param), r.text
    assert r.json()["error"]["message"].startswith(message)


def test_non_text_content_says_only_text_is_accepted(cluster):
    image = {"type": "image_url", "image_url": {"url": "http://x"}}
    body = {"model": "demo-poet", "messages": [{"role": "user", "content": [image]}]}
    r = post(cluster, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages.0.content.0.type"
    assert r.json()["error"]["message"] == (
        'messages.0.content.0.type: a part of type "image_url"; allowed: content as a string '
        'or a list of {"type": "text", "text": "..."} parts (only text: image, audio and file '
        "parts are not supported)"
    )


@pytest.mark.parametrize(
    "path, body, param, message",
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a" * 1021}]},  # + 3 template tokens
            "messages",
            "messages: the prompt (1024 tokens) leaves no room to generate in the model's "
            "context of 1024 tokens; allowed: a prompt of at most 1023 tokens",
        ),
        (
            "/v1/completions",
            {"prompt": "a" * 1015},
            "prompt",
            "prompt: the prompt (1015 tokens) + the default max_tokens (16, used when "
            "max_tokens is not sent) exceeds the model's context of 1024 tokens; allowed: a "
            "prompt of at most 1008 tokens, or max_tokens up to 9",
        ),
    ],
)
def test_a_prompt_too_long_without_max_tokens_blames_the_prompt(
    cluster, path, body, param, message
):
    r = post(cluster, path, {"model": "demo-poet", **body})
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["message"]) == (param, message)


def _wait_resident(cluster, name: str) -> None:
    reg = cluster.registry()
    try:
        wait_for(lambda: reg.locations(name), 15, f"{name} reported resident", interval_s=0.2)
    finally:
        reg.close()


def _new_request_answers(cluster, model: str) -> list[httpx.Response]:
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return [
        post(cluster, "/v1/completions", completion(model=model)),
        post(cluster, "/v1/completions", completion(model=model, stream=True)),
        post(cluster, "/v1/chat/completions", chat),
    ]


def test_an_adapter_being_unloaded_answers_like_an_unknown_one(cluster):
    name = "extra-3"
    body = completion(model=name, max_tokens=600, temperature=0, ignore_eos=True, stream=True)
    headers = {"Authorization": f"Bearer {cluster.keys['ops']}"}
    with httpx.stream(
        "POST", f"{cluster.http}/v1/completions", json=body, headers=headers, timeout=120
    ) as inflight:
        lines = inflight.iter_lines()
        assert next(lines).startswith("data: ")
        _wait_resident(cluster, name)
        r = post(cluster, "/v1/unload_lora_adapter", {"lora_name": name}, key="admin")
        assert r.json()["state"] == "draining", r.text
        unknown = _new_request_answers(cluster, "no-such-adapter")
        unknown = [r.content.replace(b"no-such-adapter", name.encode()) for r in unknown]
        answers = _new_request_answers(cluster, name)
        assert [r.status_code for r in answers] == [404] * 3
        assert [r.content for r in answers] == unknown
        assert answers[0].json()["error"] == {
            "message": f"adapter {name!r} not found",
            "type": "invalid_request_error",
            "param": None,
            "code": "model_not_found",
        }
        assert "retry-after" not in answers[0].headers
        with pytest.raises(grpc.RpcError) as e:
            grpc_generate(cluster, model=name)
        assert (e.value.code(), e.value.details()) == (
            grpc.StatusCode.NOT_FOUND,
            f"adapter {name!r} not found",
        )
        rest = "".join(line for line in lines if line)
    assert '"finish_reason":"length"' in rest.replace(" ", "") and rest.endswith("data: [DONE]")


def test_a_prompt_no_context_can_hold_is_refused_without_stalling_others(cluster):
    """A 6 MB prompt was tokenized on the ingress's event loop (~10 s on this box, every
    other request waiting) only to be refused as too long afterwards."""
    huge = completion(prompt="a " * 3_000_000)
    answer: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answer.append(post(cluster, "/v1/completions", huge)))
    sender.start()
    waits = []
    while sender.is_alive():
        started = time.monotonic()
        r = httpx.get(f"{cluster.http}/v1/models", headers=_bearer(cluster.keys["ops"]), timeout=60)
        assert r.status_code == 200
        waits.append(time.monotonic() - started)
    sender.join()
    assert answer[0].status_code == 400, answer[0].text
    error = answer[0].json()["error"]
    assert error["param"] == "prompt"
    assert error["message"].startswith(
        "prompt: 6000000 characters cannot fit the model's context of 1024 tokens"
    )
    assert max(waits) < 2.0, f"GET /v1/models waited {max(waits):.1f} s behind the prompt"


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_non_ascii_admin_key_is_401_not_500(cluster):
    headers = {"Authorization": b"Bearer caf\xe9"}  # a Latin-1 byte, as a client may send
    r = httpx.post(
        f"{cluster.http}/v1/pin_lora_adapter", json={"lora_name": "demo-poet"}, headers=headers
    )
    assert r.status_code == 401, r.text
    assert r.json()["error"] == {
        "message": "admin endpoints need 'Authorization: Bearer <admin key>'",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }


def test_the_openai_client_streams_chunks_with_one_id_and_created(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=f"{cluster.http}/v1", api_key=cluster.keys["ops"], max_retries=0)
    stream = client.chat.completions.create(
        model="demo-poet",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=250,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    started = time.monotonic()
    chunks = list(stream)
    assert time.monotonic() - started > 1.0  # long enough to cross a second
    assert len({(c.id, c.created, c.model, c.object) for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 250


@pytest.mark.parametrize("depth", [500, 100_000])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/pin_lora_adapter"])
def test_a_deeply_nested_body_is_400_in_the_openai_shape(cluster, path, depth):
    body = f'{{"model": "demo-poet", "prompt": "x", "x": {"[" * depth}{"]" * depth}}}'
    key = ADMIN_KEY if path.endswith("adapter") else cluster.keys["ops"]
    headers = {**_bearer(key), "Content-Type": "application/json"}
    r = httpx.post(f"{cluster.http}{path}", content=body, headers=headers, timeout=60)
    assert r.status_code == 400, r.text  # was 500 (a RecursionError)
    assert r.json()["error"]["message"].startswith("body: nested ")
