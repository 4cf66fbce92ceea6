"""The protocol-independent core of the ingress (no Ray, no FastAPI, no gRPC).

REST and gRPC both turn their request into a `GenerateCall` here (`admit`: the key, the
tenant's rate limit and the adapter's resolution, before any work on the body; then
tokenize (`router.prompt_encoder`, whose PromptEncoder a Frontend is), validate lengths,
`prepare`: `router.prepared`) and read `RequestOutput`s back through `dispatch`,
which the Serve shell binds to the replica deployment handle.

Errors raised before the first output surface as the request's status; a replica
refusing an adapter version it does not hold (retryable) is retried once after
resolving the name again, and a replica refusing an adapter it is unloading answers
like resolution does for a draining adapter: not found.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from lora_core.errors import (
    AdapterDraining,
    AdapterNotFound,
    AdapterVersionUnavailable,
    InvalidRequest,
    LoraFleetError,
)
from replica.outputs import RequestOutput
from replica.sampling_params import SamplingParams
from replica.serve_protocol import GenerateCall
from router import admission
from router.admission import Admitted
from router.auth import AdapterResolver
from router.call_ids import template_call_ids
from router.errors import unwrap
from router.logprobs import TokenTable
from router.prepared import Prepared, cache_salt_of, length_refusal
from router.prompt_encoder import PromptEncoder
from router.rate_limit import TenantRateLimiter
from router.reasoning import CLOSE, OPEN, tag_ids, thinking_closed
from router.reasoning import PARSERS as REASONING_PARSERS
from router.tools import PARSERS, template_renders_tools

log = logging.getLogger("lorafleet.router")
Dispatch = Callable[[GenerateCall], AsyncGenerator[RequestOutput, None]]
VERSION_RETRIES = 1


class Frontend(PromptEncoder):
    """Turns validated requests into streams of engine outputs.

    tokenizer: the base model's HF tokenizer (same files the replicas load).
    resolver: adapter resolution + tenant auth.
    dispatch: sends one GenerateCall to a replica, yields its outputs.
    max_model_len: prompt + max_tokens allowed per request.
    prefix_cache_scope: who shares prefix-cache blocks (`router.prepared.cache_salt_of`).
    tool_call_parser: how chat's tool_choice "auto" reads calls in the output
    (`router.tools.PARSERS`; None: "auto" with tools is refused).
    reasoning_parser: how chat answers split a reasoning model's thinking into
    `reasoning_content` (`router.reasoning.PARSERS`; None: not split).
    rate_limiter: holds each tenant to its requests per minute (None: no limits); a
    request is counted once, by `admit`, whatever its prompts and n.
    """

    def __init__(
        self,
        tokenizer,
        resolver: AdapterResolver,
        dispatch: Dispatch,
        max_model_len: int,
        prefix_cache_scope: str = "tenant",
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        rate_limiter: TenantRateLimiter | None = None,
    ):
        cache_salt_of(None, None, prefix_cache_scope)  # refuses an unknown scope now
        if tool_call_parser not in (None, *PARSERS):
            raise ValueError(f"tool_call_parser={tool_call_parser!r}; allowed: None or {PARSERS}")
        self.tool_call_parser = tool_call_parser
        if reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(
                f"reasoning_parser={reasoning_parser!r}; allowed: None or {REASONING_PARSERS}"
            )
        self.reasoning_parser = reasoning_parser
        super().__init__(tokenizer, max_model_len)
        # <think>'s and </think>'s ids (`thinking_first`)
        self.think_tags = (
            (tag_ids(tokenizer, OPEN), tag_ids(tokenizer, CLOSE)) if reasoning_parser else None
        )
        if tool_call_parser and not template_renders_tools(tokenizer.chat_template):
            log.warning(
                "tool_call_parser=%s, but the model's chat template never reads `tools`: "
                "requests' tools will not reach the model (use a template that renders them)",
                tool_call_parser,
            )
        self.prefix_cache_scope = prefix_cache_scope
        self.rate_limiter = rate_limiter
        self.resolver = resolver
        self.dispatch = dispatch
        self.token_table = TokenTable(tokenizer)

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[int, ...]:
        """PromptEncoder's, the messages' call ids first made fit for the template of the
        model tool_call_parser reads (`router.call_ids.template_call_ids`: a Mistral
        template refuses ids other than 9 letters and digits), for chat, gRPC's chat
        and /tokenize alike."""
        messages = template_call_ids(messages, self.tool_call_parser)
        return await super().encode_chat(messages, tools, options)

    def thinking_first(self, prompt_ids: tuple[int, ...], params: SamplingParams) -> SamplingParams:
        """A chat's params, with structured_after set to "</think>"'s token ids when the
        model thinks before its structured output (vLLM's rule): the cluster has a
        reasoning_parser, params have a structured output (the request's own or a forced
        tool call's) and the prompt's ids, as the model gets them, did not close the
        thinking (`router.reasoning.thinking_closed`). Otherwise params as given: the
        grammar holds the output from its first token."""
        if self.think_tags is None or params.structured_outputs is None:
            return params
        opened, closed = self.think_tags
        if thinking_closed(prompt_ids, opened, closed):
            return params
        return dataclasses.replace(params, structured_after=closed)

    def room_after(self, prompt_ids: tuple[int, ...]) -> int:
        """Output tokens the prompt leaves in the context (at least 1, so a prompt that
        fills it is refused by `prepare`'s length check, naming the prompt)."""
        return max(1, self.max_model_len - len(prompt_ids))

    async def key_checked_first(self, api_key: str | None, exc: BaseException) -> BaseException:
        """The error to answer for `exc`, raised before `admit` (a body that does not
        parse): a user error (400) waits for the key check, so a caller with a bad key
        learns only that (401), as on the admin endpoints. Costs a registry round trip
        on this error path only."""
        if not isinstance(unwrap(exc), InvalidRequest):
            return exc
        try:
            await self.resolver.tenant(api_key)
        except LoraFleetError as e:
            return e
        return exc

    async def admit(self, api_key: str | None, model: str) -> Admitted:
        """The key, the tenant's rate limit and `model`'s resolution, before any work on
        the request's body (`router.admission`). Raises Unauthorized, TenantRateLimited."""
        return await admission.admit(self.resolver, self.rate_limiter, api_key, model)

    def prepare(
        self,
        admitted: Admitted,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
        *,
        prompt_field: str = "prompt",
        max_tokens_sent: bool = True,
        cache_salt: str | None = None,
    ) -> Prepared:
        """The call of one prompt of an admitted request: the length check (400) first,
        then its model's 404, if resolution refused it (`Admitted.resolution`).
        prompt_field: the body field the prompt came from (named by a length refusal);
        max_tokens_sent: False when params.max_tokens is a default the client never sent;
        cache_salt: the request's own prefix-cache salt (vLLM's field), if any."""
        too_long = length_refusal(
            len(prompt_ids), params.max_tokens, self.max_model_len, prompt_field, max_tokens_sent
        )
        if too_long is not None:
            raise too_long
        resolved = admitted.resolution()
        call = GenerateCall(
            request_id=f"req-{uuid.uuid4().hex}",
            prompt_token_ids=prompt_ids,
            params=params,
            adapter=resolved.adapter,
            residency=resolved.residency,
            cache_salt=cache_salt_of(admitted.tenant, cache_salt, self.prefix_cache_scope),
        )
        return Prepared(call=call, model=admitted.model, adapter=resolved.adapter)

    async def generate(
        self, api_key: str | None, prepared: Prepared
    ) -> AsyncIterator[RequestOutput]:
        """Yields the replica's outputs; retries a version refusal before the first output."""
        call = prepared.call
        for attempt in range(VERSION_RETRIES + 1):
            started = False
            try:
                # Closing this generator closes the dispatch at once (not when the
                # collector finds it), so a client that leaves aborts the request now.
                async with aclosing(self.dispatch(call)) as outputs:
                    async for out in outputs:
                        started = True
                        yield out
                return
            except Exception as e:
                err = unwrap(e)
                if not started and isinstance(err, (AdapterDraining, AdapterNotFound)):
                    raise AdapterNotFound(prepared.model) from None
                if (
                    started
                    or attempt == VERSION_RETRIES
                    or not isinstance(err, AdapterVersionUnavailable)
                ):
                    raise err from None
            fresh = await self.resolver.resolve(api_key, prepared.model)
            call = dataclasses.replace(
                call,
                request_id=f"{prepared.call.request_id}-r{attempt + 1}",
                adapter=fresh.adapter,
                residency=fresh.residency,
            )
