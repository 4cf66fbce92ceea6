"""vLLM's /tokenize and /detokenize over a real Frontend and tokenizer (fake registry,
auth on): the ids the inference routes would send, the chat template's rendering, the
round trip, and the same key and model checks as inference."""

import asyncio
import json

import pytest

from router import tokenize
from router.auth import AdapterResolver
from router.frontend import Frontend
from tests.unit.router.test_frontend_auth import BASE, Dispatcher, FakeRegistry, tokenizer

__all__ = ["tokenizer"]  # the module fixture, shared
MAX_LEN = 64
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


@pytest.fixture
def front(tokenizer):
    resolver = AdapterResolver(FakeRegistry(), BASE, auth=True, admin_key="")
    return Frontend(tokenizer, resolver, Dispatcher(), MAX_LEN)


def call(route, front, body, key="k1") -> tuple[int, dict]:
    resp = asyncio.run(route(front, key, json.dumps(body).encode()))
    return resp.status_code, json.loads(resp.body)


def test_a_prompt_tokenizes_as_the_completions_route_encodes_it(front, tokenizer):
    text = "hello world, hello lorafleet"
    status, body = call(tokenize.tokenize, front, {"prompt": text})
    assert status == 200
    assert body["tokens"] == list(asyncio.run(front.encode_prompt(text)))
    assert body["tokens"] == tokenizer(text).input_ids
    assert body == {
        "count": len(body["tokens"]),
        "max_model_len": MAX_LEN,
        "tokens": body["tokens"],
        "token_strs": None,
    }
    _, strs = call(tokenize.tokenize, front, {"prompt": text, "return_token_strs": True})
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    assert len(strs["token_strs"]) == body["count"] > 1
    _, empty = call(tokenize.tokenize, front, {"prompt": "", "model": "a1"})
    assert empty["count"] == 0 and empty["tokens"] == []


def test_messages_render_as_the_chat_route_renders_them(front, tokenizer):
    status, body = call(tokenize.tokenize, front, {"messages": CHAT, "model": BASE})
    assert status == 200
    assert body["tokens"] == list(asyncio.run(front.encode_chat(CHAT)))
    _, bare = call(tokenize.tokenize, front, {"messages": CHAT, "add_generation_prompt": False})
    expected = tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=False, tokenize=True, return_dict=False
    )
    assert bare["tokens"] == list(expected) != body["tokens"]


def test_detokenize_inverts_tokenize_and_checks_the_ids(front, tokenizer):
    text = "Grüße, world"
    _, tok = call(tokenize.tokenize, front, {"prompt": text})
    status, body = call(tokenize.detokenize, front, {"tokens": tok["tokens"], "model": "a2"})
    assert (status, body) == (200, {"prompt": text})
    status, body = call(tokenize.detokenize, front, {"tokens": [1, len(tokenizer)]})
    assert status == 400 and body["error"]["param"] == "tokens"
    assert f"token id {len(tokenizer)} out of range" in body["error"]["message"]


@pytest.mark.parametrize("route", [tokenize.tokenize, tokenize.detokenize])
def test_keys_and_models_are_checked_as_on_inference(front, route):
    body = {"prompt": "hi"} if route is tokenize.tokenize else {"tokens": [5]}
    assert call(route, front, body)[0] == 200
    assert call(route, front, body, key=None)[0] == 401
    assert call(route, front, body, key="wrong")[0] == 401
    unknown = call(route, front, body | {"model": "nope"})
    forbidden = call(route, front, body | {"model": "a1"}, key="k2")  # t1's private adapter
    assert unknown[0] == forbidden[0] == 404
    assert unknown[1] == forbidden[1] | {
        "error": forbidden[1]["error"] | {"message": unknown[1]["error"]["message"]}
    }
    assert "'nope'" in unknown[1]["error"]["message"]
    assert "'a1'" in forbidden[1]["error"]["message"]
    assert call(route, front, body | {"model": "a1"}, key="k1")[0] == 200


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": "a", "messages": CHAT}, None, "exactly one of prompt"),
        ({}, None, "exactly one of prompt"),
        ({"prompt": 5}, "prompt", ""),
        ({"messages": CHAT, "add_special_tokens": True}, None, "add_special_tokens"),
        ({"messages": CHAT, "chat_template_kwargs": {"tokenize": 1}}, "chat_template_kwargs", ""),
        ({"messages": CHAT, "chat_template": "{{x}}"}, "chat_template", ""),
    ],
)
def test_a_bad_tokenize_body_is_a_400(front, body, param, words):
    status, out = call(tokenize.tokenize, front, body)
    assert status == 400, out
    if param is not None:
        assert out["error"]["param"] == param
    assert words in out["error"]["message"]
    assert call(tokenize.tokenize, front, body, key="wrong")[0] == 401  # the key first
