"""gRPC chat's tool calling end to end, through Serve's gRPC proxy: tool_choice "required"
gives the calls REST's chat gives for the same body, and a bad tool field ends the call
INVALID_ARGUMENT naming it. That a stream's chunks carry REST's deltas, "auto" included,
is tests/unit/router/test_grpc_tools.py's (reasoning: test_reasoning_structured.py's).

One app with one replica, shared with this package's other modules (conftest.py).
"""

from __future__ import annotations

import json

import grpc
import pytest

from router.proto import lorafleet_pb2 as pb
from tests.integration.serve.sampling.test_sampling_api import MESSAGES, create
from tests.integration.serve.sampling.test_tools_api import TOOLS

pytestmark = pytest.mark.integration


def _request(**fields) -> pb.GenerateRequest:
    turns = [pb.ChatTurn(role=m["role"], content=m["content"]) for m in MESSAGES]
    return pb.GenerateRequest(model="demo-poet", messages=turns, **fields)


def test_a_required_call_is_rest_call(cluster):
    whole = create(cluster, "chat", max_tokens=48, temperature=0, tools=TOOLS,
                   tool_choice="required", parallel_tool_calls=False)  # fmt: skip
    choice = whole.choices[0]
    want = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    req = _request(max_tokens=48, temperature=0, tools_json=json.dumps(TOOLS),
                   tool_choice="required", parallel_tool_calls=False)  # fmt: skip
    chunks = list(cluster.grpc_stub().Generate(req, metadata=cluster.grpc_auth(), timeout=60))
    calls = [d for c in chunks for d in c.tool_calls]
    assert [(d.name, json.loads(d.arguments)) for d in calls] == want and len(want) == 1
    assert calls[0].id.startswith("call_") and calls[0].type == "function"
    assert calls[0].id != choice.message.tool_calls[0].id
    assert "".join(c.text for c in chunks) == "" and choice.message.content is None
    finishes = [c.finish_reason for c in chunks if c.finish_reason]
    assert finishes == [choice.finish_reason] == ["tool_calls"]


def test_a_bad_tool_is_invalid_argument_naming_it(cluster):
    bad = [*TOOLS, {"type": "function", "function": {"name": "f", "parameters": 3}}]
    req = _request(max_tokens=4, tools_json=json.dumps(bad), tool_choice="required")
    with pytest.raises(grpc.RpcError) as e:
        list(cluster.grpc_stub().Generate(req, metadata=cluster.grpc_auth(), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("tools_json[2].function.parameters: allowed: a JSON")
