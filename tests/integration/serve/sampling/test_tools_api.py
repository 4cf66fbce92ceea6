"""Tool calling and reasoning end to end, through the OpenAI client: a named call and a
"required" one (streamed, joined as the client joins deltas, equal to the whole
response), and "auto" read by the cluster's tool_call_parser (hermes; streamed, a call's
arguments come in pieces). That each forced call is HF's greedy output under its grammar
is tests/unit/router/test_rest_tools.py's; a reasoning model's thinking, before a
structured answer or not, is tests/unit/router/test_reasoning_structured.py's (over a
real engine and a model whose </think> is one token). gRPC's messages answer as REST's
chat does.

One app with one replica, shared with this package's other modules (conftest.py).
"""

from __future__ import annotations

import json

import pytest

from router.proto import lorafleet_pb2 as pb
from tests.integration.serve.sampling.test_sampling_api import MESSAGES, create
from tests.unit.router.test_rest_tools import CITY, HERMES_REGEX
from tests.unit.router.test_tools import CLOCK

pytestmark = pytest.mark.integration
TOOLS = [CITY, CLOCK]


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def test_a_named_call_answers_its_arguments(cluster):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = create(cluster, "chat", max_tokens=48, temperature=0, tools=TOOLS, tool_choice=named)
    choice = r.choices[0]
    [(name, arguments)] = _calls(choice.message)
    assert choice.message.content is None and choice.finish_reason == "stop"
    assert name == "get_weather" and arguments["city"] in ("oslo", "lima")
    assert choice.message.tool_calls[0].id.startswith("call_")


def test_a_required_call_streams_as_it_answers(cluster):
    fields = dict(max_tokens=48, temperature=0, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False)  # fmt: skip
    whole = create(cluster, "chat", **fields)
    assert whole.choices[0].finish_reason == "tool_calls"
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in create(cluster, "chat", stream=True, **fields):
        for c in chunk.choices:
            for call in c.delta.tool_calls or ():
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            finish = c.finish_reason or finish
    streamed = [(name, json.loads(arguments)) for name, arguments in calls.values()]
    assert streamed == _calls(whole.choices[0].message) and finish == "tool_calls"


def test_auto_reads_the_calls_the_model_writes(cluster):
    # a random model writes no call unless a regex makes it ("auto" only reads the text)
    fields = dict(max_tokens=160, temperature=0, tools=TOOLS,
                  extra_body={"structured_outputs": {"regex": HERMES_REGEX}})  # fmt: skip
    choice = create(cluster, "chat", **fields).choices[0]
    assert choice.message.content == "Sure. " and choice.finish_reason == "tool_calls"
    [(name, arguments)] = _calls(choice.message)
    assert name == "get_weather" and set(arguments) == {"city"}
    # streamed: the name first, then the arguments in pieces as they are generated
    pieces = [
        call.function
        for chunk in create(cluster, "chat", stream=True, **fields)
        for c in chunk.choices
        for call in c.delta.tool_calls or ()
    ]
    assert pieces[0].name == "get_weather" and pieces[0].arguments == "" and len(pieces) > 2
    assert "".join(p.arguments for p in pieces) == choice.message.tool_calls[0].function.arguments


def test_grpc_messages_answer_as_rest_chat(cluster):
    rest = create(cluster, "chat", max_tokens=12, temperature=0)
    turns = [pb.ChatTurn(role=m["role"], content=m["content"]) for m in MESSAGES]
    req = pb.GenerateRequest(model="demo-poet", messages=turns, max_tokens=12, temperature=0)
    chunks = list(cluster.grpc_stub().Generate(req, metadata=cluster.grpc_auth(), timeout=60))
    assert "".join(c.text for c in chunks) == rest.choices[0].message.content
    assert chunks[-1].finish_reason == rest.choices[0].finish_reason
