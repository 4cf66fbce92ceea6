"""gRPC's chat (GenerateRequest fields 31-35, 37-38, ChatTurn's tool fields): rendered by the
chat template as REST's chat renders it (the same token ids), template variables and
fields, tools and earlier calls included; a chat given with a prompt, chat fields without messages, and bad
turns, variables or tools are INVALID_ARGUMENT-class refusals naming the gRPC field, in
the words REST's chat uses for the same body."""

from __future__ import annotations

import asyncio
import json

import pytest

from lora_core.errors import InvalidRequest
from router.body_parse import parse_body
from router.grpc_chat import chat_of, prompt_ids_of
from router.grpc_service import sampling_of
from router.openai_protocol import ChatCompletionRequest
from router.proto import lorafleet_pb2 as pb
from router.tools import plan_of
from tests.unit.router.test_frontend_auth import Dispatcher, make_front, tokenizer
from tests.unit.router.test_tools import CLOCK, WEATHER, fn

__all__ = ["tokenizer"]  # the shared fixture
TURNS = [("system", "be brief"), ("user", "hi there")]
NAMED = {"type": "function", "function": {"name": "now"}}
BAD_PATTERN = fn(
    "f", parameters={"type": "object", "properties": {"a": {"type": "string", "pattern": "a("}}}
)


def ids_of(front, req: pb.GenerateRequest) -> tuple[int, ...]:
    async def go():
        return await prompt_ids_of(front, req, await chat_of(req))

    return asyncio.run(go())


def _request(**fields) -> pb.GenerateRequest:
    turns = fields.pop("turns", TURNS)
    return pb.GenerateRequest(
        model="m", messages=[pb.ChatTurn(role=r, content=c) for r, c in turns], **fields
    )


def test_messages_render_as_rest_chat_renders_them(tokenizer):
    front = make_front(tokenizer, Dispatcher(), max_len=256)
    ids = ids_of(front, _request())
    dicts = [{"role": r, "content": c} for r, c in TURNS]
    assert ids == tuple(asyncio.run(front.encode_chat(dicts)))
    assert ids == tuple(
        tokenizer.apply_chat_template(dicts, add_generation_prompt=True, return_dict=False)
    )
    assert ids_of(front, pb.GenerateRequest(prompt="hi")) == tuple(tokenizer("hi").input_ids)


PREFILLED = [("user", "name a colour"), ("assistant", "the colour is")]


@pytest.mark.parametrize(
    "fields",
    [
        {"continue_final_message": True},
        {"continue_final_message": True, "add_generation_prompt": False},
        {"add_generation_prompt": False},
        {"add_generation_prompt": True},
    ],
)
def test_template_fields_render_as_rest_chat_renders_them(tokenizer, fields):
    front = make_front(tokenizer, Dispatcher(), max_len=256)
    ids = ids_of(front, _request(turns=PREFILLED, **fields))
    messages = [{"role": r, "content": c} for r, c in PREFILLED]
    rest = parse_body(ChatCompletionRequest, {"model": "m", "messages": messages, **fields})
    assert ids == asyncio.run(front.encode_chat(rest.chat_dicts(), None, rest.template_options()))
    opened = tokenizer.decode(ids).endswith("<|assistant|>the colour is")
    assert opened == bool(fields.get("continue_final_message"))


def test_template_variables_reach_the_template(tokenizer):
    front = make_front(tokenizer, Dispatcher(), max_len=256)
    front._encoder.chat_template = "{% if shout %}LOUD {% endif %}" + tokenizer.chat_template
    loud = ids_of(front, _request(chat_template_kwargs_json='{"shout": true}'))
    quiet = ids_of(front, _request())
    assert tokenizer.decode(loud).startswith("LOUD ") and loud[-len(quiet) :] == quiet


def test_tools_and_earlier_calls_render_as_rest_renders_them(tokenizer):
    front = make_front(tokenizer, Dispatcher(), max_len=1024)
    call = pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "oslo"}')
    turns = [
        pb.ChatTurn(role="user", content="weather in oslo?"),
        pb.ChatTurn(role="assistant", tool_calls=[call]),
        pb.ChatTurn(role="tool", content="sunny", tool_call_id="call_1"),
    ]
    req = pb.GenerateRequest(
        model="m", messages=turns, tools_json=json.dumps([WEATHER, CLOCK]), tool_choice="none"
    )
    rest = parse_body(
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "weather in oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "oslo"}'}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
            ],
            "tools": [WEATHER, CLOCK],
            "tool_choice": "none",
        },
    )  # fmt: skip
    want = asyncio.run(
        front.encode_chat(
            rest.chat_dicts(), rest.tool_plan.template_tools(), rest.template_options()
        )
    )
    ids = ids_of(front, req)
    assert ids == want
    text = tokenizer.decode(ids)
    assert '"name": "get_weather", "arguments": {"city": "oslo"}' in text  # the earlier call
    assert '"name": "now"' in text and "sunny" in text  # the tools' list, the tool's answer


@pytest.mark.parametrize(
    "choice, parallel, want",
    [
        ("", None, plan_of([WEATHER, CLOCK], None, None)),  # unset: "auto" with tools
        ("none", None, plan_of([WEATHER, CLOCK], "none", None)),
        ("required", False, plan_of([WEATHER, CLOCK], "required", False)),
        (json.dumps(NAMED), None, plan_of([WEATHER, CLOCK], NAMED, None)),
        (" " + json.dumps(NAMED), True, plan_of([WEATHER, CLOCK], NAMED, True)),
    ],
)
def test_tool_fields_read_into_rest_plan(choice, parallel, want):
    req = _request(tools_json=json.dumps([WEATHER, CLOCK]), tool_choice=choice)
    if parallel is not None:
        req.parallel_tool_calls = parallel
    chat = asyncio.run(chat_of(req))
    assert chat.tool_plan == want
    params = sampling_of(req, chat)
    assert params.structured_outputs == want.grammar()


TWO = json.dumps([WEATHER, CLOCK])
# gRPC fields -> the REST body fields asking the same (None: no REST counterpart to compare)
BAD_TOOLS = [
    ({"tools_json": '{"a": 1}'}, {"tools": {"a": 1}}, "tools_json",
     "tools_json: got dict; allowed: a list of at most 128 tools"),
    ({"tools_json": json.dumps([WEATHER, fn("f", parameters=[1])])},
     {"tools": [WEATHER, fn("f", parameters=[1])]}, "tools_json",
     "tools_json[1].function.parameters: allowed: a JSON schema (an object)"),
    ({"tools_json": json.dumps([CLOCK, CLOCK])}, {"tools": [CLOCK, CLOCK]}, "tools_json",
     "tools_json[1].function.name: 'now' is named twice"),
    ({"tools_json": json.dumps([CLOCK, BAD_PATTERN]), "tool_choice": "required"},
     {"tools": [CLOCK, BAD_PATTERN], "tool_choice": "required"}, "tools_json",
     "tools_json[1].function.parameters: Regex"),
    ({"tools_json": TWO, "tool_choice": "any"}, {"tools": [WEATHER, CLOCK], "tool_choice": "any"},
     "tool_choice", 'tool_choice: got "any"; allowed: "none", "auto", "required"'),
    ({"tools_json": TWO, "tool_choice": '{"type": "function", "function": {"name": "x"}}'},
     {"tools": [WEATHER, CLOCK], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", "tool_choice.function.name: 'x' is not one of tools"),
    ({"tool_choice": "required"}, {"tool_choice": "required"}, "tool_choice",
     'tool_choice: "required" with no tools'),
    ({"tools_json": "[", "tool_choice": "none"}, None, "tools_json",
     "tools_json is not valid JSON (Expecting value); allowed: a JSON array of tools"),
    ({"tools_json": TWO, "tool_choice": "{"}, None, "tool_choice", "tool_choice is not valid JSON"),
    ({"tools_json": '[{"type": "function", "function": {"name": "f", "description": "\\ud800"}}]'},
     None, "tools_json.0.function.description", "not valid Unicode text (lone surrogate"),
    ({"tools_json": "[" * 64 + "]" * 64}, None, "tools_json", "tools_json: nested more than 63"),
]  # fmt: skip


@pytest.mark.parametrize("fields, rest_fields, param, words", BAD_TOOLS)
def test_bad_tools_are_refused_as_rest_refuses_them(fields, rest_fields, param, words):
    with pytest.raises(InvalidRequest) as e:
        asyncio.run(chat_of(_request(**fields)))
    assert words in str(e.value) and e.value.param == param
    if rest_fields is not None:  # REST's words, its field renamed
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **rest_fields}
        with pytest.raises(InvalidRequest) as rest:
            parse_body(ChatCompletionRequest, body)
        assert str(e.value) == str(rest.value).replace("tools[", "tools_json[", 1).replace(
            "tools:", "tools_json:", 1
        )


def _call_turn(role: str, arguments: str = "{}", tool_call_id: str = "") -> pb.ChatTurn:
    call = pb.ToolCall(id="c", name="f", arguments=arguments)
    return pb.ChatTurn(role=role, content="x", tool_calls=[call], tool_call_id=tool_call_id)


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"prompt": "x"}, "messages", "messages: given with prompt; allowed: one of prompt"),
        ({"prompt_token_ids": [1]}, "messages", "given with prompt_token_ids"),
        ({"turns": [("wizard", "x")]}, "messages.0.role", "messages.0.role: got \"wizard\""),
        ({"turns": [("user", "x")], "chat_template_kwargs_json": "{"}, "chat_template_kwargs_json",
         "chat_template_kwargs_json is not valid JSON"),
        ({"chat_template_kwargs_json": json.dumps({"tokenize": 1})}, "chat_template_kwargs",
         "is a parameter of apply_chat_template"),
        ({"turns": [], "chat_template_kwargs_json": "{}"}, "chat_template_kwargs_json",
         "allowed only with messages"),
        ({"turns": [], "prompt": "x", "tools_json": TWO}, "tools_json",
         "tools_json: allowed only with messages"),
        ({"turns": [], "prompt": "x", "tool_choice": "none"}, "tool_choice",
         "tool_choice: allowed only with messages"),
        ({"turns": [], "prompt": "x", "parallel_tool_calls": False}, "parallel_tool_calls",
         "parallel_tool_calls: allowed only with messages"),
        ({"add_generation_prompt": True, "continue_final_message": True},
         "add_generation_prompt",
         "add_generation_prompt: true with continue_final_message: true; allowed: one of them"),
        ({"turns": [], "prompt": "x", "continue_final_message": True}, "continue_final_message",
         "continue_final_message: allowed only with messages"),
        ({"turns": [], "prompt": "x", "add_generation_prompt": False}, "add_generation_prompt",
         "add_generation_prompt: allowed only with messages"),
        ({"messages": [_call_turn("user")]}, "messages.0",
         'tool_calls: in a "user" message; allowed only for role "assistant"'),
        ({"messages": [_call_turn("assistant", "{")]}, "messages.0.tool_calls.0.arguments",
         "messages.0.tool_calls.0.arguments: not the JSON text of an object"),
        ({"messages": [pb.ChatTurn(role="user", content="x", tool_call_id="c")]}, "messages.0",
         'tool_call_id: in a "user" message; allowed only for role "tool"'),
    ],
)  # fmt: skip
def test_bad_chats_are_refused_naming_the_field(tokenizer, fields, param, words):
    front = make_front(tokenizer, Dispatcher(), max_len=256)
    req = _request(**fields) if "messages" not in fields else pb.GenerateRequest(**fields)
    with pytest.raises(InvalidRequest) as e:
        ids_of(front, req)
    assert words in str(e.value) and e.value.param == param


def test_forced_calls_go_with_no_structured_output_and_auto_needs_a_parser(tokenizer):
    req = _request(tools_json=TWO, tool_choice="required", structured_regex="a+")
    with pytest.raises(InvalidRequest) as e:
        sampling_of(req, asyncio.run(chat_of(req)))
    assert e.value.param == "tool_choice" and str(e.value).startswith(
        'tool_choice: "required" forces a call, given with a structured output (structured_*)'
    )
    auto = _request(tools_json=TWO, structured_regex="a+")  # "auto" only reads the text
    assert sampling_of(auto, asyncio.run(chat_of(auto))).structured_outputs.kind == "regex"
    front = make_front(tokenizer, Dispatcher(), max_len=1024)  # no tool_call_parser
    with pytest.raises(InvalidRequest, match="cluster arg tool_call_parser") as e:
        ids_of(front, auto)
    assert e.value.param == "tool_choice"
