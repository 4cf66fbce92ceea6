"""REST handlers of the OpenAI API on top of `Frontend` (Ray-free; FastAPI wiring is ingress.py).

Each handler returns a Starlette response. Errors before the first token become an
OpenAI error JSON with the table's status; an error after streaming began is sent as
one last SSE `data: {"error": ...}` event (the status line is already out). A request
is admitted (`Frontend.admit`: key, tenant rate limit, adapter) before its body is
rendered or tokenized, so a bad key or a tenant past its limit costs no tokenizing.

`n` choices are n engine requests of one resolved, tokenized prompt (`Prepared.choices`),
started together: the status is sent once every choice has its first output, and the
first error of any choice is the answer (or a stream's error event) while the others
are aborted, as they are when the client leaves. Stream chunks carry one choice each,
in arrival order; the usage chunk and [DONE] come once, after all choices ended.

A completion with `echo` puts the prompt (`Echo`) before each choice's text, on the
choice's first output, with the prompt's logprobs first when logprobs were asked for.
The engine sends them with a request's first output (`RequestOutput.prompt_logprobs`),
but of the choices of one prompt a replica scores the prompt for one only, the first it
queues (`replica.async_engine`): every choice echoes the scores of the first choice whose
first output carries them. All choices have their first output before anything is sent,
so each stream's first chunk has the scores to echo. A prompt `truncate_prompt_tokens`
cut is truncated here, before anything reads it (the length checks, usage, echo, prompt
scores), and echoed as its kept tokens decoded, so the echo and its logprobs agree.

A chat whose text is read, for tool calls (`router.tools`) or a reasoning model's
thinking (`router.reasoning`), sends each choice's text through a `router.chat_reader`:
a stream's chunks are the reader's deltas, a whole response's message their join, so
the two agree.

`prompt_logprobs` (vLLM's field; not streamed) returns the same scores in vLLM's shape
(`router.prompt_logprobs`): on each completion choice, of its own prompt, and on a chat
response; the engine scores with the larger k when echo's logprobs ask too.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from http import HTTPStatus

from starlette.responses import JSONResponse, Response, StreamingResponse

from lora_core.errors import ReplicaFailed
from replica.outputs import RequestOutput
from replica.prompt_truncation import kept_prompt
from replica.sampling_params import SamplingParams
from router.chat_reader import ChatReader, reader_of
from router.choices import batch_of, batch_usage, total_usage
from router.errors import error_json, openai_error_body, status_for, unwrap
from router.fanout import all_or_first_error, close_all, merge_streams
from router.frontend import Frontend
from router.logprobs import LogprobReader
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from router.openai_responses import (
    Head,
    Piece,
    Usage,
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
    sse,
    usage_chunk,
)
from router.prepared import Prepared
from router.prompt_logprobs import prompt_logprobs_json


def error_response(exc: BaseException) -> JSONResponse:
    exc = unwrap(exc)
    status = status_for(exc)
    headers = {}
    if status.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(status.retry_after_s)))
    return JSONResponse(openai_error_body(exc), status_code=status.http, headers=headers)


ROUTES = (
    "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET "
    "/v1/models/{model}, GET /health, POST /v1/{load,unload,pin,unpin,warm}_lora_adapter"
)


def route_error_response(
    method: str, path: str, http: int, headers: dict[str, str]
) -> JSONResponse:
    """The OpenAI error JSON for the router's own refusals (unknown route, wrong method)."""
    if http == 405:
        allowed = headers.get("Allow", "")
        message = f"method {method} is not allowed on {path}; allowed: {allowed}"
        body = error_json(message, "invalid_request_error", "method_not_allowed")
    elif http == 404:
        message = f"no route {method} {path}; allowed: {ROUTES}"
        body = error_json(message, "invalid_request_error", "not_found")
    else:
        body = error_json(HTTPStatus(http).phrase, "invalid_request_error", f"http_{http}")
    return JSONResponse(body, status_code=http, headers=headers)


async def refusal(front: Frontend, api_key: str | None, exc: BaseException) -> JSONResponse:
    """`error_response` for an error before `Frontend.admit` (a body that does not
    parse), the key checked first. Errors after it need no such check: admit checked."""
    return error_response(await front.key_checked_first(api_key, exc))


@dataclass(frozen=True)
class Echo:
    """The prompt a completion with `echo` returns before each choice's text.

    text: the prompt as sent (a token-id prompt decoded as generated text is); ids: its
    tokens; scores: the output that carries their logprobs, the first output of the
    choice of this prompt that scored it (None: the choice's own first output); k: the
    logprobs k (top tokens per position) of the request."""

    text: str
    ids: tuple[int, ...]
    scores: RequestOutput | None = None
    k: int = 0


def piece_of(out: RequestOutput, reader: LogprobReader | None, echo: Echo | None = None) -> Piece:
    """reader: the request's logprob reader, None when logprobs were not asked for;
    echo: the prompt to put first (given with a choice's first output only)."""
    entries = []
    if reader is not None and echo:
        entries = reader.read_prompt(echo.ids, echo.scores or out, echo.text, echo.k)
    entries += reader.read(out) if reader is not None else []
    text = echo.text + out.new_text if echo else out.new_text
    return Piece(text, entries, out.finish_reason)


def _reader(front: Frontend, want_logprobs: bool, skip_special: bool) -> LogprobReader | None:
    """skip_special: the request's skip_special_tokens (off: special tokens are text)."""
    if not want_logprobs:
        return None
    return LogprobReader(front.token_table, specials_in_text=not skip_special)


async def _collect(
    outputs: AsyncIterator[RequestOutput], reader: LogprobReader | None, echo: Echo | None
):
    whole, usage = Piece(), Usage()
    async for out in outputs:
        p = piece_of(out, reader, echo)
        echo = None
        whole.text += p.text
        whole.logprobs += p.logprobs
        whole.finish_reason = p.finish_reason
        usage = Usage(out.num_prompt_tokens, out.num_output_tokens)
    return whole, usage


Started = tuple[AsyncGenerator[RequestOutput, None], RequestOutput | None]
"""A choice's output stream and its first item (None: it ended without one)."""


async def _start(front: Frontend, api_key: str | None, prepared: Prepared) -> Started:
    """The output stream and its first item (errors raise here, before any byte is sent)."""
    outputs = front.generate(api_key, prepared)
    try:
        first = await anext(outputs)
    except StopAsyncIteration:
        first = None
    return outputs, first


async def _start_all(front: Frontend, api_key: str | None, choices: list[Prepared]):
    """`_start` of every choice, concurrently: the response's status is decided once all
    have begun (or one failed: the others are aborted and its error is the answer)."""
    started: list[Started | None] = [None] * len(choices)

    async def start(i: int, prepared: Prepared) -> None:
        started[i] = await _start(front, api_key, prepared)

    try:
        await all_or_first_error([start(i, p) for i, p in enumerate(choices)])
    except BaseException:
        await close_all([s[0] for s in started if s is not None])
        raise
    return started


# A non-streamed answer has sent nothing yet when its replica dies: it starts again.
REPLICA_FAILED_RETRIES = 1


async def _collect_whole(
    front: Frontend,
    api_key: str | None,
    prepared: Prepared,
    started: Started,
    reader: Callable,
    echo: Echo | None,
):
    """`_collect` of one choice of a non-streamed request. reader: makes a fresh
    LogprobReader (or None) per attempt. A ReplicaFailed starts the choice again on
    another replica (the client has seen nothing of the failed attempt)."""
    outputs, first = started
    for _ in range(REPLICA_FAILED_RETRIES):
        try:
            return await _collect(_chain(first, outputs), reader(), echo)
        except Exception as e:
            if not isinstance(unwrap(e), ReplicaFailed):
                raise
        prepared = prepared.again()
        outputs, first = await _start(front, api_key, prepared)
    return await _collect(_chain(first, outputs), reader(), echo)


async def _collect_all(
    front: Frontend,
    api_key: str | None,
    choices: list[Prepared],
    started,
    reader: Callable,
    echoes: list[Echo | None] | None = None,
) -> tuple[list[Piece], list[Usage]]:
    """Every choice of a non-streamed request, concurrently; the first error (after its
    choice's own retry) aborts the others and is the answer. echoes: each choice's."""
    echoes = echoes or [None] * len(choices)
    try:
        wholes = await all_or_first_error(
            [
                _collect_whole(front, api_key, p, s, reader, echo)
                for p, s, echo in zip(choices, started, echoes, strict=True)
            ]
        )
    finally:
        # choices whose collection never began still hold their first output
        await close_all([outputs for outputs, _ in started])
    return [w[0] for w in wholes], [w[1] for w in wholes]


async def _chain(first: RequestOutput | None, rest: AsyncIterator[RequestOutput]):
    if first is not None:
        yield first
        async for out in rest:
            yield out


def _merged(started: list[Started]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(choice index, output) of a streamed request's choices, as they come."""
    return merge_streams([_chain(first, outputs) for outputs, first in started])


async def completions(front: Frontend, api_key: str | None, req: CompletionRequest) -> Response:
    """One prompt or a batch: prompt i's choice j is the response's choice i * n + j."""
    prompts = batch_of(req.prompt)
    try:
        admitted = await front.admit(api_key, req.model)  # one request, however many prompts
        params = req.to_sampling_params()
        whole = [await front.encode_prompt(p) for p in prompts]
        ids = [params.kept_prompt(one, front.max_model_len) for one in whole]
        prepared = [
            front.prepare(
                admitted,
                one,
                params,
                max_tokens_sent=req.max_tokens_sent,
                cache_salt=req.cache_salt,
            )
            for one in ids
        ]
        choices = [c for p in prepared for c in p.choices(req.n)]
        started = await _start_all(front, api_key, choices)
    except Exception as e:
        return error_response(e)
    head = Head.now(prepared[0].call.request_id.replace("req-", "cmpl-"), req.model)
    want_lp, skip = req.logprobs is not None, params.skip_special_tokens
    scores = [_scored(started[i * req.n : (i + 1) * req.n]) for i in range(len(prompts))]
    # a truncated prompt echoes the tokens it kept, decoded, as a token-id prompt does
    sent = [p if len(one) == len(w) else one for p, one, w in zip(prompts, ids, whole, strict=True)]
    echoes = [
        _echo(front, p, one, scored, req.logprobs or 0, skip) if req.echo else None
        for p, one, scored in zip(sent, ids, scores, strict=True)
        for _ in range(req.n)
    ]
    if not req.stream:
        try:
            wholes, usages = await _collect_all(
                front, api_key, choices, started, lambda: _reader(front, want_lp, skip), echoes
            )
        except Exception as e:
            return error_response(e)
        usage = batch_usage(usages, req.n)
        body = completion_body(head, wholes, usage, want_lp)
        if req.returns_prompt_logprobs:  # each choice its own prompt's
            per_prompt = [
                prompt_logprobs_json(one, scored, req.prompt_logprobs, front.token_table)
                for one, scored in zip(ids, scores, strict=True)
            ]
            for i, choice in enumerate(body["choices"]):
                choice["prompt_logprobs"] = per_prompt[i // req.n]
        return JSONResponse(body)
    body = _completion_events(front, started, req, head, echoes)
    return StreamingResponse(body, media_type="text/event-stream")


def _scored(started: list[Started]) -> RequestOutput | None:
    """The first output carrying the prompt's logprobs among one prompt's choices (a
    replica computes them for one of the choices it runs), None when none asked."""
    return next((f for _, f in started if f is not None and f.prompt_logprobs is not None), None)


def _echo(
    front: Frontend,
    prompt: str | list[int] | tuple[int, ...],
    ids: tuple[int, ...],
    scores: RequestOutput | None,
    k: int,
    skip_special: bool,
) -> Echo:
    """prompt: the text sent, or token ids (a token-id or truncated prompt), decoded as
    the engine decodes generated ids (replica.detokenizer: no HF space clean-up, special
    tokens as skip_special says)."""
    if isinstance(prompt, str):
        return Echo(prompt, ids, scores, k)
    text = front.tokenizer.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special)
    return Echo(text, ids, scores, k)


async def _completion_events(
    front: Frontend, started, req: CompletionRequest, head: Head, echoes: list[Echo | None]
):
    want_lp, skip = req.logprobs is not None, req.skip_special_tokens
    readers = [_reader(front, want_lp, skip) for _ in started]
    echoes = list(echoes)  # each choice's first chunk echoes its prompt
    usages = [Usage() for _ in started]
    try:
        async with aclosing(_merged(started)) as merged:
            async for i, out in merged:
                piece = piece_of(out, readers[i], echoes[i])
                echoes[i] = None
                yield sse(completion_chunk(head, i, piece, want_lp))
                usages[i] = Usage(out.num_prompt_tokens, out.num_output_tokens)
        if req.include_usage:
            usage = batch_usage(usages, req.n)
            yield sse(usage_chunk(head, "text_completion", usage))
    except Exception as e:
        yield sse(openai_error_body(unwrap(e)))
    finally:  # a client that left aborts every choice now, wherever the stream was
        await close_all([outputs for outputs, _ in started])
    yield sse("[DONE]")


async def chat_completions(
    front: Frontend, api_key: str | None, req: ChatCompletionRequest
) -> Response:
    plan = req.tool_plan
    try:
        admitted = await front.admit(api_key, req.model)
        plan.check_parser(front.tool_call_parser)
        ids = await front.encode_chat(
            req.chat_dicts(), plan.template_tools(), req.template_options()
        )
        ids = kept_prompt(ids, req.truncate_prompt_tokens, front.max_model_len)
        params = front.thinking_first(ids, req.to_sampling_params(front.room_after(ids)))
        if plan.keeps_special_tokens(front.tool_call_parser):  # the calls' marker is one
            params = replace(params, skip_special_tokens=False)
        prepared = front.prepare(
            admitted,
            ids,
            params,
            prompt_field="messages",
            max_tokens_sent=req.max_tokens_sent,
            cache_salt=req.cache_salt,
        )
        choices = prepared.choices(req.n)
        started = await _start_all(front, api_key, choices)
    except Exception as e:
        return error_response(e)
    head = Head.now(prepared.call.request_id.replace("req-", "chatcmpl-"), req.model)
    if not req.stream:
        try:
            wholes, usages = await _collect_all(
                front,
                api_key,
                choices,
                started,
                lambda: _reader(front, req.logprobs, params.skip_special_tokens),
            )
        except Exception as e:
            return error_response(e)
        messages = None
        if _chat_reader(front, req, params) is not None:
            messages = []
            for w in wholes:
                reader = _chat_reader(front, req, params)
                message, w.finish_reason = reader.whole(w.text, w.finish_reason)
                messages.append(message)
        body = chat_body(head, wholes, total_usage(usages), req.logprobs, messages)
        if req.returns_prompt_logprobs:  # on the response, as vLLM's chat has it
            body["prompt_logprobs"] = prompt_logprobs_json(
                ids, _scored(started), req.prompt_logprobs, front.token_table
            )
        return JSONResponse(body)
    body = _chat_events(front, started, req, head, params)
    return StreamingResponse(body, media_type="text/event-stream")


async def _chat_events(
    front: Frontend, started, req: ChatCompletionRequest, head: Head, params: SamplingParams
):
    readers = [_reader(front, req.logprobs, params.skip_special_tokens) for _ in started]
    chats = [_chat_reader(front, req, params) for _ in started]
    usages = [Usage() for _ in started]
    try:
        for i in range(len(started)):  # each choice's first chunk names the role (as vLLM)
            yield sse(chat_chunk(head, i, {"role": "assistant", "content": ""}, None, False))
        async with aclosing(_merged(started)) as merged:
            async for i, out in merged:
                p = piece_of(out, readers[i])
                if chats[i] is not None:
                    for chunk in _read_chunks(head, i, chats[i], p, req.logprobs):
                        yield sse(chunk)
                else:
                    # "content" even when empty (a token that ends inside a UTF-8 character,
                    # a finish without text), as vLLM sends it: clients read delta.content
                    yield sse(chat_chunk(head, i, {"content": p.text}, p, req.logprobs))
                usages[i] = Usage(out.num_prompt_tokens, out.num_output_tokens)
        if req.include_usage:
            yield sse(usage_chunk(head, "chat.completion.chunk", total_usage(usages)))
    except Exception as e:
        yield sse(openai_error_body(unwrap(e)))
    finally:
        await close_all([outputs for outputs, _ in started])
    yield sse("[DONE]")


def _chat_reader(
    front: Frontend, req: ChatCompletionRequest, params: SamplingParams
) -> ChatReader | None:
    """A fresh reader of one choice's text (None: the text is sent as it comes)."""
    parsers = front.tool_call_parser, front.reasoning_parser
    return reader_of(
        req.tool_plan, params.structured_outputs, *parsers, bool(params.structured_after)
    )


def _read_chunks(
    head: Head, index: int, stream: ChatReader, p: Piece, want_logprobs: bool
) -> list[dict]:
    """The chunks of one output of a choice whose text is read (reasoning, tool calls):
    a chunk per delta the reader sends (none while it holds text back), the output's
    logprobs on the first, its finish reason on the last (an empty delta carries them
    when the reader sent nothing, as OpenAI's last chunk has)."""
    deltas = stream.feed(p.text) + (stream.end() if p.finish_reason else [])
    finish = stream.finish_reason(p.finish_reason)
    if not deltas and (p.logprobs or finish is not None):
        deltas = [{}]
    last = len(deltas) - 1
    return [
        chat_chunk(
            head,
            index,
            delta,
            Piece(p.text, p.logprobs if j == 0 else [], finish if j == last else None),
            want_logprobs,
        )
        for j, delta in enumerate(deltas)
    ]
