"""The gRPC `lorafleet.v1.Inference` service, as methods of the ingress deployment.

The Serve gRPC proxy calls `Generate` / `ListModels` on the ingress by name; the
methods share `Frontend` with REST, so resolution, auth, routing and the error table
are the same. `n` choices are n engine requests, as on REST (`router.choices`), their
chunks interleaved, each naming its choice; the first error of any choice ends the call
and aborts the others. Errors set the status from `router.errors` on the Serve gRPC
context and raise; a client cancel cancels this generator, which cancels the replica
calls and aborts the requests in the engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

import numpy as np
from ray.serve.grpc_util import RayServegRPCContext

from lora_core.errors import InvalidRequest
from replica.outputs import RequestOutput
from replica.sampling_params import SamplingParams
from router.auth import bearer_key
from router.body_checks import check_cache_salt, check_top_count
from router.choices import check_n
from router.errors import public_message, status_for, unwrap
from router.fanout import merge_streams
from router.frontend import Frontend
from router.proto import lorafleet_pb2 as pb


def grpc_api_key(context: RayServegRPCContext) -> str | None:
    for key, value in context.invocation_metadata():
        if key.lower() == "authorization":
            return bearer_key(value)
    return None


def shortest(x: float) -> float:
    """A proto float32 as the shortest decimal that is the same float32 (2.01, not
    2.009999990463257), so values and messages match REST's."""
    return float(str(np.float32(x)))


def sampling_of(req: pb.GenerateRequest) -> SamplingParams:
    """Unset fields mean their default: 0 is max_tokens 16 and top_p 1 (neither takes 0),
    and off for top_k and the presence / frequency penalties; repetition_penalty is
    optional, so an explicit 0 is refused as REST refuses it."""
    repetition = shortest(req.repetition_penalty) if req.HasField("repetition_penalty") else 1.0
    return SamplingParams(
        max_tokens=req.max_tokens or 16,
        temperature=shortest(req.temperature),
        top_p=shortest(req.top_p) or 1.0,
        top_k=req.top_k,
        seed=req.seed if req.HasField("seed") else None,
        stop_token_ids=tuple(req.stop_token_ids),
        min_tokens=req.min_tokens,
        logprobs=req.HasField("logprobs"),
        top_logprobs=_top_count(req),
        stop=tuple(req.stop),
        presence_penalty=shortest(req.presence_penalty),
        frequency_penalty=shortest(req.frequency_penalty),
        repetition_penalty=repetition,
        logit_bias={token: shortest(bias) for token, bias in req.logit_bias.items()},
    )


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


def logprobs_of(out: RequestOutput) -> list[pb.TokenLogprob]:
    """The chunk's logprobs: one per new token id (none unless asked for)."""
    tops = out.new_top_logprobs or [()] * len(out.new_logprobs)
    return [
        pb.TokenLogprob(logprob=lp, top=[pb.TopToken(token_id=t, logprob=v) for t, v in top])
        for lp, top in zip(out.new_logprobs, tops, strict=True)
    ]


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
    if status.retry_after_s is not None:
        retry = str(max(1, round(status.retry_after_s)))
        # Serve's gRPC proxy drops trailing metadata when the call ends in an error, so
        # the hint also rides in the details, which always reach the client.
        details = f"{details} (retry after {retry} s)"
        context.set_trailing_metadata([("retry-after", retry)])
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
            if not request.model:
                raise InvalidRequest(
                    "model: required (an adapter name or the base model name)", "model"
                )
            n = choices_of(request)
            prompt = request.prompt or list(request.prompt_token_ids)
            ids = await front.encode_prompt(prompt)
            params = sampling_of(request)
            prepared = await front.prepare(
                api_key,
                request.model,
                ids,
                params,
                max_tokens_sent=request.max_tokens > 0,
                cache_salt=cache_salt_of_request(request),
            )
            streams = [front.generate(api_key, p) for p in prepared.choices(n)]
            async with aclosing(merge_streams(streams)) as merged:
                async for index, out in merged:
                    yield pb.GenerateChunk(
                        text=out.new_text,
                        token_ids=out.new_token_ids,
                        finish_reason=out.finish_reason or "",
                        index=index,
                        logprobs=logprobs_of(out),
                    )
        except Exception as e:
            raise _fail(grpc_context, await front.key_checked_first(api_key, e)) from None

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
