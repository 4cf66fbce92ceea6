"""gRPC's messages (GenerateRequest fields 31-32): rendered by the chat template as REST's
chat renders them (the same token ids), template variables included; a chat given with a
prompt, or bad turns and variables, are INVALID_ARGUMENT-class refusals naming the field."""

from __future__ import annotations

import asyncio
import json

import pytest

from lora_core.errors import InvalidRequest
from router.grpc_service import prompt_ids_of
from router.proto import lorafleet_pb2 as pb
from tests.unit.router.test_frontend_auth import Dispatcher, make_front, tokenizer

__all__ = ["tokenizer"]  # the shared fixture
TURNS = [("system", "be brief"), ("user", "hi there")]


def _request(**fields) -> pb.GenerateRequest:
    turns = fields.pop("turns", TURNS)
    return pb.GenerateRequest(
        model="m", messages=[pb.ChatTurn(role=r, content=c) for r, c in turns], **fields
    )


def test_messages_render_as_rest_chat_renders_them(tokenizer):
    front = make_front(tokenizer, Dispatcher(), max_len=256)
    ids = asyncio.run(prompt_ids_of(front, _request()))
    dicts = [{"role": r, "content": c} for r, c in TURNS]
    assert ids == tuple(asyncio.run(front.encode_chat(dicts)))
    assert ids == tuple(
        tokenizer.apply_chat_template(dicts, add_generation_prompt=True, return_dict=False)
    )
    assert asyncio.run(prompt_ids_of(front, pb.GenerateRequest(prompt="hi"))) == tuple(
        tokenizer("hi").input_ids
    )


def test_template_variables_reach_the_template(tokenizer):
    front = make_front(tokenizer, Dispatcher(), max_len=256)
    front._encoder.chat_template = "{% if shout %}LOUD {% endif %}" + tokenizer.chat_template
    loud = asyncio.run(prompt_ids_of(front, _request(chat_template_kwargs_json='{"shout": true}')))
    quiet = asyncio.run(prompt_ids_of(front, _request()))
    assert tokenizer.decode(loud).startswith("LOUD ") and loud[-len(quiet) :] == quiet


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"prompt": "x"}, "messages", "messages: given with prompt; allowed: one of prompt"),
        ({"prompt_token_ids": [1]}, "messages", "given with prompt_token_ids"),
        ({"turns": [("wizard", "x")]}, "messages.0.role", "messages.0.role: got \"wizard\""),
        ({"turns": [("user", "x")], "chat_template_kwargs_json": "{"}, "chat_template_kwargs_json",
         "not JSON"),
        ({"chat_template_kwargs_json": json.dumps({"tokenize": 1})}, "chat_template_kwargs",
         "is a parameter of apply_chat_template"),
        ({"turns": [], "chat_template_kwargs_json": "{}"}, "chat_template_kwargs_json",
         "allowed only with messages"),
    ],
)  # fmt: skip
def test_bad_chats_are_refused_naming_the_field(tokenizer, fields, param, words):
    front = make_front(tokenizer, Dispatcher(), max_len=256)
    with pytest.raises(InvalidRequest) as e:
        asyncio.run(prompt_ids_of(front, _request(**fields)))
    assert words in str(e.value) and e.value.param == param
