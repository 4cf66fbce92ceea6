"""gRPC's chat (GenerateRequest.messages and the fields that go with it), read as REST's
chat reads its body, and its output read as REST's chat stream reads it.

The chat fields become a body of REST's shapes, validated by the same models and checks
(`router.openai_protocol.ChatMessage`, `router.chat_options`, `router.tools.plan_of`),
so a refusal says what REST's says, naming the gRPC field:

    messages[i]                  {"role", "content", "tool_calls"?, "tool_call_id"?}
    chat_template_kwargs_json    the JSON object, as chat_template_kwargs
    add_generation_prompt        when set
    continue_final_message       when true
    tools_json                   the JSON array, as tools (named tools_json in messages)
    tool_choice                  "none" / "auto" / "required", or a JSON object's text
    parallel_tool_calls          when set

A chat's output goes through the reader REST's stream uses (`router.chat_reader`): each
engine output becomes one GenerateChunk per delta REST sends (`read_chunks`).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, Self

from pydantic import Field, PrivateAttr, model_validator

from lora_core.errors import InvalidRequest
from replica.sampling_params import SamplingParams
from replica.structured_spec import StructuredOutput
from router.body_parse import load_json, parse_body
from router.chat_options import ChatTemplateFields
from router.chat_reader import ChatReader, Delta, reader_of
from router.frontend import Frontend
from router.openai_protocol import BODY_CONFIG, ChatMessage, chat_dicts
from router.proto import lorafleet_pb2 as pb
from router.structured_request import GRPC_STRUCTURED_FIELDS
from router.tools import CHOICES_ALLOWED, ToolPlan, forcing_grammar, plan_of

CHAT_ONLY = (
    "chat_template_kwargs_json",
    "tools_json",
    "tool_choice",
    "parallel_tool_calls",
    "add_generation_prompt",
    "continue_final_message",
)
"""GenerateRequest's fields that a prompt request must leave unset."""
OPTIONAL_FLAGS = ("parallel_tool_calls", "add_generation_prompt")
"""CHAT_ONLY's optional bools: set even when false."""
TOOLS_ALLOWED = 'a JSON array of tools, [{"type": "function", "function": {...}}, ...]'


class GrpcChat(ChatTemplateFields):
    """A GenerateRequest's chat, checked as REST's chat checks its body. tools_json,
    tool_choice, parallel_tool_calls: as REST's tools (`router.tools.plan_of`)."""

    model_config = BODY_CONFIG

    messages: list[ChatMessage] = Field(min_length=1)
    tools_json: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    _tool_plan: ToolPlan = PrivateAttr(default=ToolPlan((), "none"))

    @model_validator(mode="after")
    def _read_tools(self) -> Self:
        self._tool_plan = plan_of(
            self.tools_json, self.tool_choice, self.parallel_tool_calls, "tools_json"
        )
        return self

    @property
    def tool_plan(self) -> ToolPlan:
        return self._tool_plan

    def structured(self, own: StructuredOutput | None) -> StructuredOutput | None:
        """The output's grammar: the request's own structured output (`own`, from its
        structured_* fields) or the one forcing its tool call; both is InvalidRequest."""
        try:
            forced = forcing_grammar(self.tool_plan, self.tool_choice, own, GRPC_STRUCTURED_FIELDS)
        except ValueError as e:
            raise InvalidRequest(str(e), "tool_choice") from None
        return own or forced


def body_of(req: pb.GenerateRequest) -> dict[str, Any]:
    """The chat fields of a request with messages, as a body of REST's shapes."""
    body: dict[str, Any] = {"messages": [_turn(t) for t in req.messages]}
    if req.chat_template_kwargs_json:
        body["chat_template_kwargs"] = load_json(
            req.chat_template_kwargs_json, "chat_template_kwargs_json", "a JSON object"
        )
    if req.tools_json:
        body["tools_json"] = load_json(req.tools_json, "tools_json", TOOLS_ALLOWED)
    if req.tool_choice:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    for name in OPTIONAL_FLAGS:
        if req.HasField(name):
            body[name] = getattr(req, name)
    if req.continue_final_message:
        body["continue_final_message"] = True
    return body


def _turn(turn: pb.ChatTurn) -> dict[str, Any]:
    out: dict[str, Any] = {"role": turn.role, "content": turn.content}
    if turn.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in turn.tool_calls
        ]
    if turn.tool_call_id:
        out["tool_call_id"] = turn.tool_call_id
    return out


def _tool_choice(text: str) -> object:
    """A JSON object's text is the object; any other text is the choice itself."""
    if text.lstrip().startswith("{"):
        return load_json(text, "tool_choice", CHOICES_ALLOWED.removeprefix("allowed: "))
    return text


# REST's ToolCall nests name and arguments in "function"; ChatTurn's ToolCall does not
_REST_CALL_FIELD = re.compile(r"\b(messages\.\d+\.tool_calls\.\d+)\.function\.")


async def chat_of(req: pb.GenerateRequest) -> GrpcChat | None:
    """The request's chat, checked (None: a prompt request, refused if it sets a chat
    field). Tools may carry a grammar to build: parsed off the event loop, as REST's."""
    if not req.messages:
        for name in CHAT_ONLY:
            if _given(req, name):
                raise InvalidRequest(f"{name}: allowed only with messages", name)
        return None
    if req.prompt or req.prompt_token_ids:
        given = "prompt" if req.prompt else "prompt_token_ids"
        raise InvalidRequest(
            f"messages: given with {given}; allowed: one of prompt, prompt_token_ids and messages",
            "messages",
        )
    body = body_of(req)
    try:
        if req.tools_json:
            return await asyncio.to_thread(parse_body, GrpcChat, body)
        return parse_body(GrpcChat, body)
    except InvalidRequest as e:
        param = e.param and _REST_CALL_FIELD.sub(r"\1.", e.param)
        raise InvalidRequest(_REST_CALL_FIELD.sub(r"\1.", str(e)), param) from None


async def prompt_ids_of(
    front: Frontend, req: pb.GenerateRequest, chat: GrpcChat | None
) -> tuple[int, ...]:
    """The prompt's token ids: prompt (else prompt_token_ids) encoded, or the chat
    (`chat_of`) rendered by the chat template with its tools and variables; a chat whose
    tool_choice needs the cluster's tool-call parser is refused without one, as REST's."""
    if chat is None:
        return await front.encode_prompt(req.prompt or list(req.prompt_token_ids))
    plan = chat.tool_plan
    plan.check_parser(front.tool_call_parser)
    return await front.encode_chat(
        chat_dicts(chat.messages), plan.template_tools(), chat.template_options()
    )


def chat_readers(
    front: Frontend, chat: GrpcChat | None, params: SamplingParams, n: int
) -> list[ChatReader] | None:
    """A reader per choice of a chat whose text is read for tool calls or reasoning, as
    REST's chat reads it (None: the text is sent as it comes)."""
    if chat is None:
        return None
    parsers = front.tool_call_parser, front.reasoning_parser
    after = bool(params.structured_after)
    readers = [
        reader_of(chat.tool_plan, params.structured_outputs, *parsers, after) for _ in range(n)
    ]
    return None if readers[0] is None else readers


def _given(req: pb.GenerateRequest, name: str) -> bool:
    """Whether a field is set: an optional one (`OPTIONAL_FLAGS`) even to false."""
    return req.HasField(name) if name in OPTIONAL_FLAGS else bool(getattr(req, name))


def read_chunks(chunk: pb.GenerateChunk, reader: ChatReader) -> list[pb.GenerateChunk]:
    """One engine output's chunk (`router.grpc_service.chunk_of`) of a choice whose text
    is read: one chunk per delta of REST's stream (`router.rest._read_chunks`), the
    output's token ids, logprobs and prompt scores on the first, the reader's finish
    reason and the usage on the last; a chunk without text when the reader sent nothing
    (it holds the text back), so every token id is still sent."""
    engine_finish = chunk.finish_reason or None
    deltas = reader.feed(chunk.text) + (reader.end() if engine_finish else [])
    first = pb.GenerateChunk()
    first.CopyFrom(chunk)
    first.text, first.finish_reason = "", ""
    first.ClearField("usage")
    out = [first] + [pb.GenerateChunk(index=chunk.index) for _ in deltas[1:]]
    for c, delta in zip(out, deltas or [{}], strict=True):
        _set_delta(c, delta)
    out[-1].finish_reason = reader.finish_reason(engine_finish) or ""
    if chunk.HasField("usage"):
        out[-1].usage.CopyFrom(chunk.usage)
    return out


def _set_delta(chunk: pb.GenerateChunk, delta: Delta) -> None:
    assert set(delta) <= {"content", "reasoning_content", "tool_calls"}, delta
    chunk.text = delta.get("content") or ""
    chunk.reasoning_content = delta.get("reasoning_content") or ""
    for call in delta.get("tool_calls", ()):
        fn = call["function"]
        chunk.tool_calls.add(
            index=call["index"],
            id=call.get("id", ""),
            type=call.get("type", ""),
            name=fn.get("name", ""),
            arguments=fn.get("arguments", ""),
        )
