"""REST handlers of the OpenAI API on top of `Frontend` (Ray-free; FastAPI wiring is ingress.py).

Each handler returns a Starlette response. Errors before the first token become an
OpenAI error JSON with the table's status; an error after streaming began is sent as
one last SSE `data: {"error": ...}` event (the status line is already out).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse

from replica.outputs import RequestOutput
from router.errors import openai_error_body, status_for, unwrap
from router.frontend import Frontend, Prepared
from router.logprobs import LogprobReader
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from router.openai_responses import (
    Piece,
    Usage,
    chat_body,
    chat_chunk,
    completion_body,
    sse,
    usage_chunk,
)


def error_response(exc: BaseException) -> JSONResponse:
    exc = unwrap(exc)
    status = status_for(exc)
    headers = {}
    if status.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(status.retry_after_s)))
    return JSONResponse(openai_error_body(exc), status_code=status.http, headers=headers)


def piece_of(out: RequestOutput, reader: LogprobReader | None) -> Piece:
    """reader: the request's logprob reader, None when logprobs were not asked for."""
    entries = reader.read(out) if reader is not None else []
    return Piece(out.new_text, entries, out.finish_reason)


def _reader(front: Frontend, want_logprobs: bool) -> LogprobReader | None:
    return LogprobReader(front.token_table) if want_logprobs else None


async def _collect(outputs: AsyncIterator[RequestOutput], reader: LogprobReader | None):
    whole, usage = Piece(), Usage()
    async for out in outputs:
        p = piece_of(out, reader)
        whole.text += p.text
        whole.logprobs += p.logprobs
        whole.finish_reason = p.finish_reason
        usage = Usage(out.num_prompt_tokens, out.num_output_tokens)
    return whole, usage


async def _start(front: Frontend, api_key: str | None, prepared: Prepared):
    """The output stream and its first item (errors raise here, before any byte is sent)."""
    outputs = front.generate(api_key, prepared)
    try:
        first = await anext(outputs)
    except StopAsyncIteration:
        first = None
    return outputs, first


async def _chain(first: RequestOutput | None, rest: AsyncIterator[RequestOutput]):
    if first is not None:
        yield first
        async for out in rest:
            yield out


async def completions(front: Frontend, api_key: str | None, req: CompletionRequest) -> Response:
    try:
        ids = front.encode_prompt(req.prompt)
        prepared = await front.prepare(api_key, req.model, ids, req.to_sampling_params())
        outputs, first = await _start(front, api_key, prepared)
    except Exception as e:
        return error_response(e)
    rid, want_lp = prepared.call.request_id.replace("req-", "cmpl-"), req.logprobs is not None
    if not req.stream:
        try:
            whole, usage = await _collect(_chain(first, outputs), _reader(front, want_lp))
        except Exception as e:
            return error_response(e)
        return JSONResponse(completion_body(rid, req.model, whole, usage, want_lp))

    def chunk(p: Piece) -> dict[str, Any]:
        return completion_body(rid, req.model, p, None, want_lp)

    reader = _reader(front, want_lp)
    body = _completion_events(_chain(first, outputs), chunk, reader, req, rid)
    return StreamingResponse(body, media_type="text/event-stream")


async def _completion_events(outputs, chunk: Callable, reader, req, rid):
    usage = Usage()
    try:
        async for out in outputs:
            yield sse(chunk(piece_of(out, reader)))
            usage = Usage(out.num_prompt_tokens, out.num_output_tokens)
        if req.include_usage:
            yield sse(usage_chunk(rid, req.model, "text_completion", usage))
    except Exception as e:
        yield sse(openai_error_body(unwrap(e)))
    yield sse("[DONE]")


async def chat_completions(
    front: Frontend, api_key: str | None, req: ChatCompletionRequest
) -> Response:
    try:
        ids = front.encode_chat(req.chat_dicts())
        prepared = await front.prepare(api_key, req.model, ids, req.to_sampling_params())
        outputs, first = await _start(front, api_key, prepared)
    except Exception as e:
        return error_response(e)
    rid = prepared.call.request_id.replace("req-", "chatcmpl-")
    if not req.stream:
        try:
            whole, usage = await _collect(_chain(first, outputs), _reader(front, req.logprobs))
        except Exception as e:
            return error_response(e)
        return JSONResponse(chat_body(rid, req.model, whole, usage, req.logprobs))
    body = _chat_events(front, _chain(first, outputs), req, rid)
    return StreamingResponse(body, media_type="text/event-stream")


async def _chat_events(front: Frontend, outputs, req: ChatCompletionRequest, rid: str):
    usage, reader = Usage(), _reader(front, req.logprobs)
    yield sse(chat_chunk(rid, req.model, {"role": "assistant", "content": ""}, None, False))
    try:
        async for out in outputs:
            p = piece_of(out, reader)
            delta = {"content": p.text} if p.text else {}
            yield sse(chat_chunk(rid, req.model, delta, p, req.logprobs))
            usage = Usage(out.num_prompt_tokens, out.num_output_tokens)
        if req.include_usage:
            yield sse(usage_chunk(rid, req.model, "chat.completion.chunk", usage))
    except Exception as e:
        yield sse(openai_error_body(unwrap(e)))
    yield sse("[DONE]")
