"""The chat-template fields (router.chat_options) on /tokenize and chat completions:
continue_final_message leaves the last message open, chat_template_kwargs reach the
template, both render as HF's apply_chat_template does; bad values are 400s naming the
field."""

from __future__ import annotations

import copy

import pytest

from deploy.demo import CHAT_TEMPLATE
from router import tokenize
from router.chat_options import MAX_KWARGS
from tests.unit.replica.engines import small_engine
from tests.unit.router.served_engine import served_frontend
from tests.unit.router.test_frontend_auth import tokenizer
from tests.unit.router.test_rest_text_options import post
from tests.unit.router.test_tokenize_routes import call, front

__all__ = ["front", "tokenizer"]  # the shared fixtures
PREFILLED = [
    {"role": "user", "content": "name a colour"},
    {"role": "assistant", "content": "the colour is"},
]


def hf_ids(tok, messages, **options) -> list[int]:
    return tok.apply_chat_template(messages, tokenize=True, return_dict=False, **options)


def test_continue_final_message_leaves_the_last_message_open(front, tokenizer):
    status, body = call(
        tokenize.tokenize, front, {"messages": PREFILLED, "continue_final_message": True}
    )
    assert status == 200
    want = hf_ids(tokenizer, PREFILLED, continue_final_message=True, add_generation_prompt=False)
    assert body["tokens"] == want
    assert tokenizer.decode(want).endswith("<|assistant|>the colour is")
    closed = call(tokenize.tokenize, front, {"messages": PREFILLED})[1]["tokens"]
    assert closed == hf_ids(tokenizer, PREFILLED, add_generation_prompt=True) != want


def test_template_kwargs_reach_the_template(front, tokenizer):
    front._encoder = copy.deepcopy(tokenizer)
    front._encoder.chat_template = (
        "{% if enable_thinking %}<|system|>think<|end|>{% endif %}" + CHAT_TEMPLATE
    )
    body = {"messages": PREFILLED[:1], "chat_template_kwargs": {"enable_thinking": True}}
    status, out = call(tokenize.tokenize, front, body)
    assert status == 200
    want = hf_ids(front._encoder, PREFILLED[:1], add_generation_prompt=True, enable_thinking=True)
    assert out["tokens"] == want
    assert tokenizer.decode(want).startswith("<|system|>think<|end|>")
    off = call(
        tokenize.tokenize, front, {**body, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert off[1]["tokens"] == hf_ids(tokenizer, PREFILLED[:1], add_generation_prompt=True)


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt",
         "add_generation_prompt: true with continue_final_message: true; allowed: one of them"),
        ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs",
         'key "tokenize" is a parameter of apply_chat_template'),
        ({"chat_template_kwargs": {"a-b": 1}}, "chat_template_kwargs", 'key "a-b" is no name'),
        ({"chat_template_kwargs": {f"k{i}": 1 for i in range(MAX_KWARGS + 1)}},
         "chat_template_kwargs", f"{MAX_KWARGS + 1} keys; allowed: at most {MAX_KWARGS}"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs", ""),
    ],
)  # fmt: skip
def test_bad_template_fields_are_400s_naming_the_field(front, fields, param, words):
    status, out = call(tokenize.tokenize, front, {"messages": PREFILLED, **fields})
    assert status == 400 and out["error"]["param"] == param
    assert words in out["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_continues_its_prefilled_answer(llama_dir, stream):
    engine = small_engine(llama_dir)
    with served_frontend(engine) as served:
        body = {"messages": PREFILLED, "continue_final_message": True, "max_tokens": 3,
                "temperature": 0, "stream": stream, "stream_options": {"include_usage": True}}  # fmt: skip
        if not stream:
            del body["stream_options"]
        status, result = post(served, "chat", body)
    assert status == 200
    usage = result["usage"] if not stream else result[-1]["usage"]
    want = hf_ids(
        engine.tokenizer, PREFILLED, continue_final_message=True, add_generation_prompt=False
    )
    assert usage["prompt_tokens"] == len(want)
