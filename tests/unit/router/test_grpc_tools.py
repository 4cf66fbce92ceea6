"""gRPC chat's tool calls and reasoning through a real gRPC server in-process (grpc.aio on
a unix socket; the ingress's GrpcInferenceMixin over a Frontend and a CPU AsyncEngine,
called as Serve's proxy calls it; no Ray): a stream's chunks carry the deltas and finish
reasons of REST's stream for the same request (tool_choice "required", named, "auto" read
by the hermes parser), every generated token id arrives, and bad tool fields end the call
INVALID_ARGUMENT naming the field. Thinking split by a reasoning parser, before a forced
call or not: tests/unit/router/test_reasoning_structured.py."""

from __future__ import annotations

import asyncio
import json
import tempfile

import grpc
import pytest
from ray.serve.grpc_util import RayServegRPCContext

from router.chat_reader import joined
from router.grpc_service import GrpcInferenceMixin
from router.proto import lorafleet_pb2 as pb
from router.proto import lorafleet_pb2_grpc as pb_grpc
from router.tools import plan_of
from tests.unit.replica.engines import small_engine
from tests.unit.router.served_engine import served_frontend
from tests.unit.router.test_frontend_auth import BASE
from tests.unit.router.test_rest_text_options import post
from tests.unit.router.test_rest_tools import CITY, HERMES_REGEX, MESSAGES, NAMED
from tests.unit.router.test_tools import CLOCK

TOOLS = [CITY, CLOCK]


class Ingress(GrpcInferenceMixin):
    def __init__(self, frontend):
        self.frontend = frontend


class ServeLikeServicer(pb_grpc.InferenceServicer):
    """Calls the ingress's Generate as Serve's gRPC proxy does: with a RayServegRPCContext,
    whose code and details end the call when Generate raises."""

    def __init__(self, ingress: Ingress):
        self.ingress = ingress

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        ray_context = RayServegRPCContext(context)
        try:
            async for chunk in self.ingress.Generate(request, ray_context):
                yield chunk
        except Exception:
            await context.abort(ray_context.code(), ray_context.details())


def generate(front, req: pb.GenerateRequest) -> list[pb.GenerateChunk]:
    """The chunks of one Generate call to a gRPC server serving `front`."""

    async def go():
        server = grpc.aio.server()
        pb_grpc.add_InferenceServicer_to_server(ServeLikeServicer(Ingress(front)), server)
        with tempfile.TemporaryDirectory(dir="/tmp") as d:
            address = f"unix:{d}/grpc.sock"
            server.add_insecure_port(address)
            await server.start()
            try:
                async with grpc.aio.insecure_channel(address) as channel:
                    return [c async for c in pb_grpc.InferenceStub(channel).Generate(req)]
            finally:
                await server.stop(None)

    return asyncio.run(go())


@pytest.fixture(scope="module")
def served(llama_dir):
    engine = small_engine(llama_dir)
    with served_frontend(engine, tool_call_parser="hermes") as front:
        yield front


def grpc_deltas(chunks: list[pb.GenerateChunk]) -> list[tuple[dict, str | None]]:
    """(OpenAI delta, finish reason) of each chunk that carries either."""
    out = []
    for chunk in chunks:
        delta: dict = {}
        if chunk.reasoning_content:
            delta["reasoning_content"] = chunk.reasoning_content
        if chunk.text:
            delta["content"] = chunk.text
        calls = [_call(c) for c in chunk.tool_calls]
        if calls:
            delta["tool_calls"] = calls
        if delta or chunk.finish_reason:
            out.append((delta, chunk.finish_reason or None))
    return out


def _call(c: pb.ToolCallDelta) -> dict:
    if not c.id:  # more of a call's arguments
        return {"index": c.index, "function": {"arguments": c.arguments}}
    function = {"name": c.name, "arguments": c.arguments}
    return {"index": c.index, "id": c.id, "type": c.type, "function": function}


def rest_deltas(chunks: list[dict]) -> list[tuple[dict, str | None]]:
    """(delta, finish reason) of a REST stream's chunks, the role chunk left out."""
    out = []
    for chunk in chunks:
        for c in chunk["choices"]:
            if c["delta"] != {"role": "assistant", "content": ""}:
                out.append((c["delta"], c["finish_reason"]))
    return out


def ids_masked(deltas: list[tuple[dict, str | None]]) -> tuple[list, list[str]]:
    """The deltas with each call id replaced by "ID", and the ids."""
    ids = [c.pop("id") for d, _ in deltas for c in d.get("tool_calls", ()) if "id" in c]
    masked = [
        ({**d, "tool_calls": [{**c, "id": "ID"} if "type" in c else c for c in d["tool_calls"]]}
         if "tool_calls" in d else d, finish)
        for d, finish in deltas
    ]  # fmt: skip
    return masked, ids


CASES = {
    "required": ({"tool_choice": "required", "parallel_tool_calls": False}, "tool_calls"),
    "named": ({"tool_choice": NAMED}, "stop"),
    "auto": ({"structured_outputs": {"regex": HERMES_REGEX}, "max_tokens": 160}, "tool_calls"),
}


def _grpc_request(fields: dict) -> pb.GenerateRequest:
    """The gRPC request of a REST chat body's fields."""
    choice = fields.get("tool_choice", "")
    req = pb.GenerateRequest(
        model=BASE,
        messages=[pb.ChatTurn(role=m["role"], content=m["content"]) for m in MESSAGES],
        tools_json=json.dumps(fields.get("tools", [])) if "tools" in fields else "",
        tool_choice=choice if isinstance(choice, str) else json.dumps(choice),
        max_tokens=fields["max_tokens"],
        temperature=fields["temperature"],
        structured_regex=fields.get("structured_outputs", {}).get("regex", ""),
    )
    if "parallel_tool_calls" in fields:
        req.parallel_tool_calls = fields["parallel_tool_calls"]
    return req


@pytest.mark.parametrize("case", CASES)
def test_a_stream_carries_rest_deltas(served, case):
    fields, finish = CASES[case]
    fields = {"tools": TOOLS, "temperature": 0, "max_tokens": 48, **fields}
    status, rest = post(served, "chat", {**fields, "messages": MESSAGES, "stream": True})
    assert status == 200
    chunks = generate(served, _grpc_request(fields))
    got, grpc_ids = ids_masked(grpc_deltas(chunks))
    want, _ = ids_masked(rest_deltas(rest))
    assert got == want and got[-1][1] == finish
    assert grpc_ids and len(set(grpc_ids)) == len(grpc_ids)
    assert all(i.startswith("call_") for i in grpc_ids)
    if case == "auto":
        assert "".join(d.get("content", "") for d, _ in got) == "Sure. "


def test_every_token_id_arrives(served):
    fields = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    fields |= {"temperature": 0, "max_tokens": 48}
    calls = generate(served, _grpc_request(fields))
    # the same prompt and grammar, the text not read: the raw output
    grammar = plan_of(TOOLS, "required", False).grammar()
    raw_req = _grpc_request({**fields, "tool_choice": "none"})
    raw_req.ClearField("parallel_tool_calls")
    raw_req.structured_json_schema = grammar.value
    raw = generate(served, raw_req)
    assert [t for c in calls for t in c.token_ids] == [t for c in raw for t in c.token_ids]
    text = "".join(c.text for c in raw)
    want = [(c["name"], c["parameters"]) for c in json.loads(text)]
    got = [(d.name, json.loads(d.arguments)) for c in calls for d in c.tool_calls]
    assert got == want and "".join(c.text for c in calls) == ""
    assert [c.finish_reason for c in calls if c.finish_reason] == ["tool_calls"]
    assert raw[-1].finish_reason == "stop"


def test_choices_call_under_ids_of_their_own(served):
    fields = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    req = _grpc_request({**fields, "temperature": 1.0, "max_tokens": 200})
    req.n, req.seed = 3, 5
    chunks = generate(served, req)
    finishes = {c.index: c.finish_reason for c in chunks if c.finish_reason}
    assert finishes == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}
    ids = {c.index: d.id for c in chunks for d in c.tool_calls if d.id}
    assert sorted(ids) == [0, 1, 2] and len(set(ids.values())) == 3


@pytest.mark.parametrize(
    "fields, details",
    [
        ({"tools_json": json.dumps([CLOCK, {"type": "function", "function": {"name": "f",
          "parameters": 3}}])}, "tools_json[1].function.parameters: allowed: a JSON schema"),
        ({"messages": [], "prompt": "hi", "tools_json": json.dumps(TOOLS)},
         "tools_json: allowed only with messages"),
        ({"tool_choice": "required"}, 'tool_choice: "required" with no tools'),
    ],
)  # fmt: skip
def test_bad_tool_fields_are_invalid_argument(served, fields, details):
    req = pb.GenerateRequest(
        model=BASE, messages=[pb.ChatTurn(role="user", content="hi")], max_tokens=4
    )
    for name, value in fields.items():
        if name == "messages":
            req.ClearField("messages")
        else:
            setattr(req, name, value)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        generate(served, req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(details)


def test_mistral_requests_keep_special_tokens_as_rests_do(llama_dir):
    # the [TOOL_CALLS] marker is a special token in Mistral's vocabularies: a gRPC "auto"
    # chat on a mistral cluster keeps special tokens in its text, as REST's does (here
    # EOS, spelled with include_stop_str_in_output, ends the content after the call)
    from tests.unit.router.test_rest_tool_parsers import REGEXES

    engine = small_engine(llama_dir)
    regex = REGEXES["mistral"][0]
    fields = {"tools": TOOLS, "tool_choice": "auto", "temperature": 0, "max_tokens": 160}
    body = {**fields, "messages": MESSAGES, "structured_outputs": {"regex": regex},
            "include_stop_str_in_output": True}  # fmt: skip
    with served_frontend(engine, tool_call_parser="mistral") as front:
        status, rest = post(front, "chat", body)
        req = _grpc_request({**fields, "structured_outputs": {"regex": regex}})
        req.include_stop_str_in_output = True
        deltas = [d for d, _ in grpc_deltas(generate(front, req))]
    assert status == 200
    message = rest["choices"][0]["message"]
    content = "".join(d.get("content", "") for d in deltas)
    assert content == message["content"] == "Sure. " + engine.tokenizer.eos_token
    calls = [c["function"] for c in joined(deltas)["tool_calls"]]  # streamed: name, arguments
    assert calls == [c["function"] for c in message["tool_calls"]] and len(calls) == 1
