"""REST handlers over a real Frontend (fake registry and dispatch): the key is checked
before any 400, chat's default max_tokens, and the OpenAI error shape for bad routes."""

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from lora_core.errors import InvalidRequest
from router import rest
from router.auth import INVALID_KEY, MISSING_KEY, AdapterResolver
from router.body_parse import parse_body
from router.frontend import Frontend
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from tests.unit.router.test_frontend_auth import BASE, Dispatcher, FakeRegistry, tokenizer

__all__ = ["tokenizer"]  # the module fixture, shared


class CountingRegistry(FakeRegistry):
    def __init__(self):
        super().__init__()
        self.key_lookups = 0

    async def resolve_key(self, api_key):
        self.key_lookups += 1
        return await super().resolve_key(api_key)


def make_front(tokenizer, auth=True, max_len=64):
    registry, dispatch = CountingRegistry(), Dispatcher()
    resolver = AdapterResolver(registry, BASE, auth=auth, admin_key="")
    return Frontend(tokenizer, resolver, dispatch, max_len), registry, dispatch


def answer(response) -> tuple[int, dict]:
    return response.status_code, json.loads(response.body)["error"]


@pytest.mark.parametrize(
    "key, status, message",
    [("bad", 401, INVALID_KEY), (None, 401, MISSING_KEY), ("k1", 400, "max_tokens: no")],
)
def test_a_user_error_waits_for_the_key_check(tokenizer, key, status, message):
    front, _, _ = make_front(tokenizer)
    got = asyncio.run(rest.refusal(front, key, InvalidRequest("max_tokens: no", "max_tokens")))
    assert answer(got)[0] == status and answer(got)[1]["message"] == message


def test_with_auth_off_a_user_error_is_answered_at_once(tokenizer):
    front, registry, _ = make_front(tokenizer, auth=False)
    got = asyncio.run(rest.refusal(front, "bad", InvalidRequest("m", "max_tokens")))
    assert answer(got) == (400, {
        "message": "m", "type": "invalid_request_error", "param": "max_tokens",
        "code": "invalid_request",
    })  # fmt: skip
    assert registry.key_lookups == 0


@pytest.mark.parametrize("key, status", [("bad", 401), ("k1", 400)])
def test_a_too_long_prompt_with_a_bad_key_is_401(tokenizer, key, status):
    front, _, _ = make_front(tokenizer, max_len=4)
    req = parse_body(CompletionRequest, {"model": "a1", "prompt": [1, 2, 3], "max_tokens": 2})
    assert asyncio.run(rest.completions(front, key, req)).status_code == status


def test_the_happy_path_makes_one_registry_round_trip(tokenizer):
    front, registry, _ = make_front(tokenizer)
    req = parse_body(CompletionRequest, {"model": "a1", "prompt": [1, 2], "max_tokens": 2})
    assert asyncio.run(rest.completions(front, "k1", req)).status_code == 200
    assert (registry.resolves, registry.key_lookups) == (1, 0)


@pytest.mark.parametrize("fields, max_tokens", [({}, 64 - 5), ({"max_tokens": 3}, 3)])
def test_chat_max_tokens_defaults_to_the_room_left(tokenizer, fields, max_tokens):
    front, _, dispatch = make_front(tokenizer, max_len=64)
    body = {"model": "a1", "messages": [{"role": "user", "content": "hi"}], **fields}
    prompt = asyncio.run(front.encode_chat([{"role": "user", "content": "hi"}]))
    assert len(prompt) == 5
    r = asyncio.run(rest.chat_completions(front, "k1", parse_body(ChatCompletionRequest, body)))
    assert r.status_code == 200
    assert dispatch.calls[0].params.max_tokens == max_tokens


def test_completions_max_tokens_still_defaults_to_16():
    req = parse_body(CompletionRequest, {"model": "a1", "prompt": "x"})
    assert req.to_sampling_params().max_tokens == 16


CHAT = {"model": "a1", "messages": [{"role": "user", "content": "hi"}]}  # 5 tokens


@pytest.mark.parametrize(
    "body, max_len, param, message",
    [
        (
            CHAT,
            5,
            "messages",
            "messages: the prompt (5 tokens) leaves no room to generate in the model's "
            "context of 5 tokens; allowed: a prompt of at most 4 tokens",
        ),
        (
            {**CHAT, "max_tokens": None, "max_completion_tokens": None},
            4,
            "messages",
            "messages: the prompt (5 tokens) leaves no room to generate in the model's "
            "context of 4 tokens; allowed: a prompt of at most 3 tokens",
        ),
        (
            {**CHAT, "max_tokens": 3},
            5,
            "messages",
            "messages: the prompt (5 tokens) leaves no room to generate",
        ),
        (
            {**CHAT, "max_completion_tokens": 3},
            6,
            "max_tokens",
            "max_tokens: the prompt (5 tokens) + max_tokens (3) exceeds the model's context of "
            "6 tokens; allowed: max_tokens up to 1 for this prompt (at most 6 tokens in total)",
        ),
    ],
)
def test_a_chat_prompt_too_long_names_what_the_client_sent(
    tokenizer, body, max_len, param, message
):
    front, _, dispatch = make_front(tokenizer, max_len=max_len)
    r = asyncio.run(rest.chat_completions(front, "k1", parse_body(ChatCompletionRequest, body)))
    status, err = answer(r)
    assert (status, err["param"], err["code"]) == (400, param, "invalid_request")
    assert err["message"].startswith(message) and not dispatch.calls


@pytest.mark.parametrize(
    "fields, param, message",
    [
        (
            {},
            "prompt",
            "prompt: the prompt (10 tokens) + the default max_tokens (16, used when max_tokens "
            "is not sent) exceeds the model's context of 20 tokens; allowed: a prompt of at "
            "most 4 tokens, or max_tokens up to 10",
        ),
        ({"max_tokens": None}, "prompt", "prompt: the prompt (10 tokens) + the default"),
        (
            {"prompt": list(range(1, 21))},
            "prompt",
            "prompt: the prompt (20 tokens) leaves no room to generate in the model's context "
            "of 20 tokens; allowed: a prompt of at most 19 tokens",
        ),
        (
            {"max_tokens": 11},
            "max_tokens",
            "max_tokens: the prompt (10 tokens) + max_tokens (11) exceeds the model's context "
            "of 20 tokens; allowed: max_tokens up to 10 for this prompt (at most 20 tokens in "
            "total)",
        ),
    ],
)
def test_a_completion_prompt_too_long_names_what_the_client_sent(tokenizer, fields, param, message):
    front, _, dispatch = make_front(tokenizer, max_len=20)
    body = {"model": "a1", "prompt": list(range(1, 11)), **fields}
    r = asyncio.run(rest.completions(front, "k1", parse_body(CompletionRequest, body)))
    status, err = answer(r)
    assert (status, err["param"], err["code"]) == (400, param, "invalid_request")
    assert err["message"].startswith(message) and not dispatch.calls


@pytest.fixture(scope="module")
def client():
    from router.ingress import app

    return TestClient(app)


def test_an_unknown_route_answers_in_the_openai_shape(client):
    r = client.get("/v1/nope")
    assert r.status_code == 404
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", None, "not_found")
    assert err["message"].startswith("no route GET /v1/nope; allowed: POST /v1/completions")


def test_a_wrong_method_answers_in_the_openai_shape(client):
    r = client.get("/v1/completions")
    assert (r.status_code, r.json()) == (405, {
        "error": {
            "message": "method GET is not allowed on /v1/completions; allowed: POST",
            "type": "invalid_request_error", "param": None, "code": "method_not_allowed",
        }
    })  # fmt: skip
    assert r.headers["allow"] == "POST"


def test_an_unexpected_error_answers_in_the_openai_shape():
    from router.ingress import app

    async def boom():
        raise KeyError("internal detail")

    app.add_api_route("/test-boom", boom)
    try:
        r = TestClient(app, raise_server_exceptions=False).get("/test-boom")
    finally:
        app.router.routes.pop()
    assert (r.status_code, r.json()) == (500, {
        "error": {
            "message": "internal error (KeyError)",
            "type": "server_error", "param": None, "code": "internal_error",
        }
    })  # fmt: skip
