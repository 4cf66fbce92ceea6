"""The gRPC `lorafleet.v1.Inference` service, as methods of the ingress deployment.

The Serve gRPC proxy calls `Generate` / `ListModels` on the ingress by name; the
methods share `Frontend` with REST, so resolution, auth, routing and the error table
are the same. `n` choices are n engine requests, as on REST (`router.choices`), their
chunks interleaved, each naming its choice; the first error of any choice ends the call
and aborts the others. A request's `messages` are rendered by the chat template and its
output read for tool calls and reasoning, as REST's chat renders and reads them
(`router.grpc_chat`). Errors set the status from `router.errors` on the Serve gRPC
context and raise (a retry hint becomes the retry-after trailer in the proxy:
`router.grpc_proxy`); a client cancel cancels this generator, which cancels the replica
calls and aborts the requests in the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import aclosing

import numpy as np
from ray.serve.grpc_util import RayServegRPCContext

from lora_core.errors import InvalidRequest
from replica.outputs import RequestOutput, TopLogprobs
from replica.prompt_truncation import kept_prompt
from replica.sampling_params import SamplingParams
from router.auth import bearer_key
from router.body_checks import (
    COMPLETION_MAX_TOKENS,
    check_cache_salt,
    check_max_tokens,
    check_top_count,
)
from router.chat_reader import ChatReader
from router.choices import check_n
from router.errors import public_message, status_for, unwrap
from router.fanout import merge_streams
from router.frontend import Frontend
from router.grpc_chat import GrpcChat, chat_of, chat_readers, prompt_ids_of, read_chunks
from router.grpc_proxy import retry_hint
from router.proto import lorafleet_pb2 as pb
from router.structured_request import grpc_asks_grammar, grpc_structured


def grpc_api_key(context: RayServegRPCContext) -> str | None:
    for key, value in context.invocation_metadata():
        if key.lower() == "authorization":
            return bearer_key(value)
    return None


def shortest(x: float) -> float:
    """A proto float32 as the shortest decimal that is the same float32 (2.01, not
    2.009999990463257), so values and messages match REST's."""
    return float(str(np.float32(x)))


def sampling_of(
    req: pb.GenerateRequest,
    chat: GrpcChat | None = None,
    default_max_tokens: int = COMPLETION_MAX_TOKENS,
) -> SamplingParams:
    """chat: the request's chat (`chat_of`), whose forced tool call sets the grammar;
    default_max_tokens: max_tokens when unset (a chat's: the room its prompt leaves in the
    context, `Frontend.room_after`, as REST's chat). Unset fields mean their default: 0 is
    top_p 1 (which takes no 0), and off for top_k, min_p and the presence / frequency
    penalties, an empty allowed_token_ids is off (proto3 has no null list); max_tokens and
    repetition_penalty are optional, so an explicit 0 is refused as REST refuses it
    (max_tokens 0 is allowed with prompt_logprobs, as REST allows it with echo);
    skip_special_tokens and truncate_prompt_tokens are optional too (unset = true and no
    truncation)."""
    repetition = shortest(req.repetition_penalty) if req.HasField("repetition_penalty") else 1.0
    return SamplingParams(
        max_tokens=_max_tokens(req, default_max_tokens),
        temperature=shortest(req.temperature),
        top_p=shortest(req.top_p) or 1.0,
        top_k=req.top_k,
        seed=req.seed if req.HasField("seed") else None,
        stop_token_ids=tuple(req.stop_token_ids),
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        logprobs=req.HasField("logprobs"),
        top_logprobs=_top_count(req),
        stop=tuple(req.stop),
        presence_penalty=shortest(req.presence_penalty),
        frequency_penalty=shortest(req.frequency_penalty),
        repetition_penalty=repetition,
        logit_bias={token: shortest(bias) for token, bias in req.logit_bias.items()},
        prompt_logprobs=_prompt_count(req),
        min_p=shortest(req.min_p),
        allowed_token_ids=tuple(req.allowed_token_ids) or None,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=(
            req.skip_special_tokens if req.HasField("skip_special_tokens") else True
        ),
        truncate_prompt_tokens=truncation_of(req),
        structured_outputs=_structured(req, chat),
    )


def truncation_of(req: pb.GenerateRequest) -> int | None:
    """truncate_prompt_tokens (None when unset)."""
    return req.truncate_prompt_tokens if req.HasField("truncate_prompt_tokens") else None


def _structured(req: pb.GenerateRequest, chat: GrpcChat | None):
    """The structured output of the structured_* fields, checked as REST's are, or the
    grammar forcing the chat's tool call (both: refused, as REST refuses them)."""
    try:
        own = grpc_structured(req)
    except ValueError as e:
        raise InvalidRequest(str(e), str(e).split(":", 1)[0]) from None
    return own if chat is None else chat.structured(own)


def cache_salt_of_request(req: pb.GenerateRequest) -> str | None:
    """The request's cache_salt ("" is unset: proto3 strings have no null)."""
    try:
        return check_cache_salt(req.cache_salt or None)
    except ValueError as e:
        raise InvalidRequest(f"cache_salt: {e}", "cache_salt") from None


def _top_count(req: pb.GenerateRequest) -> int:
    """logprobs k (0 when unset), checked as REST checks it."""
    try:
        return check_top_count(req.logprobs) if req.HasField("logprobs") else 0
    except ValueError as e:
        raise InvalidRequest(f"logprobs: {e}", "logprobs") from None


def _prompt_count(req: pb.GenerateRequest) -> int | None:
    """prompt_logprobs k (None when unset), checked as logprobs k is."""
    try:
        return check_top_count(req.prompt_logprobs) if req.HasField("prompt_logprobs") else None
    except ValueError as e:
        raise InvalidRequest(f"prompt_logprobs: {e}", "prompt_logprobs") from None


def _max_tokens(req: pb.GenerateRequest, default: int) -> int:
    """max_tokens (default when unset): >= 1, or 0 with prompt_logprobs (REST's rule for
    echo)."""
    if not req.HasField("max_tokens"):
        return default
    try:
        return check_max_tokens(
            req.max_tokens, req.HasField("prompt_logprobs"), "prompt_logprobs set"
        )
    except ValueError as e:
        raise InvalidRequest(str(e), "max_tokens") from None


def token_logprobs(lps: list[float], tops: list[TopLogprobs] | None) -> list[pb.TokenLogprob]:
    """One TokenLogprob per logprob, with its position's most likely tokens (tops: None or
    [] when none were asked for)."""
    return [
        pb.TokenLogprob(logprob=lp, top=[pb.TopToken(token_id=t, logprob=v) for t, v in top])
        for lp, top in zip(lps, tops or [()] * len(lps), strict=True)
    ]


def chunk_of(
    index: int, out: RequestOutput, prompt_ids: tuple[int, ...], scores: RequestOutput | None = None
) -> pb.GenerateChunk:
    """Choice `index`'s chunk for one engine output: its new tokens (with their logprobs
    when asked for), on its first output when prompt_logprobs was asked for the prompt's
    ids and scores (those `scores` carries, given: `shared_prompt_scores`), and on its
    last (it has a finish_reason) the choice's usage."""
    chunk = pb.GenerateChunk(
        text=out.new_text,
        token_ids=out.new_token_ids,
        finish_reason=out.finish_reason or "",
        index=index,
        logprobs=token_logprobs(out.new_logprobs, out.new_top_logprobs),
    )
    if out.finish_reason:
        chunk.usage.prompt_tokens = out.num_prompt_tokens
        chunk.usage.completion_tokens = out.num_output_tokens
    scored = scores or out
    if scored.prompt_logprobs is not None:
        chunk.prompt_token_ids.extend(prompt_ids)
        chunk.prompt_logprobs.extend(
            token_logprobs(scored.prompt_logprobs, scored.prompt_top_logprobs)
        )
    return chunk


async def shared_prompt_scores(
    merged: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput, RequestOutput | None]]:
    """(index, output, the output carrying the prompt scores to send with it) of n choices
    asking for prompt logprobs. A replica scores the prompt for one choice of a request
    (`replica.async_engine`), so another choice's first output may carry none: it and the
    rest of its choice are held until a choice's output brings them (the scoring choice
    runs on the same replica, ahead of it), then sent with those scores. The scores come
    with first outputs only; later outputs get None."""
    scores: RequestOutput | None = None
    started: set[int] = set()
    held: list[tuple[int, RequestOutput, bool]] = []
    async for index, out in merged:
        first = index not in started
        started.add(index)
        if scores is None and out.prompt_logprobs is not None:
            scores = out
            for i, o, was_first in held:
                yield i, o, (scores if was_first else None)
            held.clear()
        if scores is None:
            held.append((index, out, first))
            continue
        yield index, out, (scores if first else None)


async def chunks_of(
    merged: AsyncIterator[tuple[int, RequestOutput]],
    ids: tuple[int, ...],
    readers: list[ChatReader] | None,
    shared_scores: bool,
) -> AsyncIterator[pb.GenerateChunk]:
    """The chunks of the choices' outputs (index, output), each output's text read by
    its choice's reader (`router.grpc_chat.read_chunks`) when there are readers.
    shared_scores: n choices asking for prompt logprobs (`shared_prompt_scores`)."""
    if shared_scores:
        outputs = shared_prompt_scores(merged)
    else:
        outputs = ((index, out, None) async for index, out in merged)
    async for index, out, scores in outputs:
        chunk = chunk_of(index, out, ids, scores)
        if readers is None:
            yield chunk
        else:
            for piece in read_chunks(chunk, readers[index]):
                yield piece


def choices_of(req: pb.GenerateRequest) -> int:
    """`n`, 0 meaning 1 (proto3's unset), as REST's 1..MAX_N."""
    try:
        return check_n(req.n or 1)
    except ValueError as e:
        raise InvalidRequest(f"n: {e}", "n") from None


def _fail(context: RayServegRPCContext, exc: BaseException) -> BaseException:
    exc = unwrap(exc)
    status = status_for(exc)
    context.set_code(status.grpc_code)
    details = public_message(exc)
    if status.retry_after_s is not None and retry_hint(details) is None:
        # Serve's gRPC proxy drops a deployment's trailing metadata when the call ends in
        # an error: the hint rides in the details, which the proxy's handlers copy into
        # the retry-after trailer (router.grpc_proxy). A message ending in it already
        # (TenantRateLimited's) is not given a second.
        details = f"{details} (retry after {max(1, round(status.retry_after_s))} s)"
    context.set_details(details)
    return exc


class GrpcInferenceMixin:
    """Mixed into the ingress class; needs `self.frontend: Frontend`."""

    frontend: Frontend

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[pb.GenerateChunk]:
        front, api_key = self.frontend, grpc_api_key(grpc_context)
        try:
            # key, tenant limit and adapter before any work on the body, as on REST
            admitted = await front.admit(api_key, request.model)
            if not request.model:
                raise InvalidRequest(
                    "model: required (an adapter name or the base model name)", "model"
                )
            n = choices_of(request)
            chat = await chat_of(request)
            ids = await prompt_ids_of(front, request, chat)
            ids = kept_prompt(ids, truncation_of(request), front.max_model_len)
            # unset max_tokens: a chat's is the room its prompt leaves, as REST chat's
            default = COMPLETION_MAX_TOKENS if chat is None else front.room_after(ids)
            if grpc_asks_grammar(request):  # its grammar is built off the event loop, as REST's
                params = await asyncio.to_thread(sampling_of, request, chat, default)
            else:
                params = sampling_of(request, chat, default)
            if chat is not None and chat.tool_plan.keeps_special_tokens(front.tool_call_parser):
                params = dataclasses.replace(params, skip_special_tokens=False)  # as REST's
            if chat is not None:  # a structured output starts after the thinking, as REST's
                params = front.thinking_first(ids, params)
            prepared = front.prepare(
                admitted,
                ids,
                params,
                prompt_field="messages" if request.messages else "prompt",
                max_tokens_sent=request.HasField("max_tokens"),
                cache_salt=cache_salt_of_request(request),
            )
            readers = chat_readers(front, chat, params, n)
            shared_scores = n > 1 and params.prompt_logprobs is not None
            streams = [front.generate(api_key, p) for p in prepared.choices(n)]
            async with (
                aclosing(merge_streams(streams)) as merged,
                aclosing(chunks_of(merged, ids, readers, shared_scores)) as chunks,
            ):
                async for chunk in chunks:
                    yield chunk
        except Exception as e:
            raise _fail(grpc_context, e) from None

    async def ListModels(  # noqa: N802 (gRPC method name)
        self, request: pb.ListModelsRequest, grpc_context: RayServegRPCContext
    ) -> pb.ListModelsReply:
        front = self.frontend
        try:
            refs = await front.resolver.visible_adapters(grpc_api_key(grpc_context))
        except Exception as e:
            raise _fail(grpc_context, e) from None
        base = front.resolver.base_name
        models = [pb.Model(id=base, parent="", version=0)]
        models += [pb.Model(id=r.name, parent=base, version=r.version) for r in refs]
        return pb.ListModelsReply(models=models)
