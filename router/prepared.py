"""One request's engine call as the ingress builds it, before dispatch (no Ray, no
FastAPI, no gRPC): the context-length check that refuses it (`length_refusal`), its
prefix-cache salt (`cache_salt_of`) and the call with the name it answers under
(`Prepared`, split into one call per choice). `router.frontend.Frontend.prepare` builds it.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

from lora_core.errors import InvalidRequest
from lora_core.identity import AdapterRef
from replica.serve_protocol import GenerateCall
from router.choices import choice_params

PREFIX_CACHE_SCOPES = ("tenant", "shared")


def cache_salt_of(tenant: str | None, salt: str | None, scope: str) -> str:
    """The engine's prefix-cache salt of a request (`GenerateCall.cache_salt`).

    scope "tenant": the caller's tenant (auth on) and the request's own salt, so tenants
    never share KV blocks and one cannot learn from the time to first token whether
    another sent a prompt; "shared": only the request's salt. Tenant names hold no NUL,
    so the salt names its parts unambiguously. Example: ("acme", None) -> "acme\0";
    ("acme", "u1") -> "acme\0u1"; (None, None) -> "" (no salt: blocks shared).
    """
    if scope not in PREFIX_CACHE_SCOPES:
        raise ValueError(f"prefix_cache_scope={scope!r}; allowed: 'tenant' or 'shared'")
    owner = tenant if scope == "tenant" and tenant else ""
    if not owner and not salt:
        return ""
    return f"{owner}\x00{salt or ''}"


def length_refusal(
    prompt_len: int, max_tokens: int, max_len: int, prompt_field: str, max_tokens_sent: bool
) -> InvalidRequest | None:
    """Why prompt_len + max_tokens does not fit the context of max_len tokens (None: it
    fits), blaming what the client sent: the prompt (prompt_field: "prompt", "messages")
    when it fills the context alone or max_tokens is a default, else max_tokens."""
    if prompt_len + max_tokens <= max_len:
        return None
    lengths = f"the prompt ({prompt_len} tokens)"
    if prompt_len >= max_len:
        return InvalidRequest(
            f"{prompt_field}: {lengths} leaves no room to generate in the model's context of "
            f"{max_len} tokens; allowed: a prompt of at most {max_len - 1} tokens",
            prompt_field,
        )
    if not max_tokens_sent:
        return InvalidRequest(
            f"{prompt_field}: {lengths} + the default max_tokens ({max_tokens}, used when "
            f"max_tokens is not sent) exceeds the model's context of {max_len} tokens; "
            f"allowed: a prompt of at most {max_len - max_tokens} tokens, or max_tokens up "
            f"to {max_len - prompt_len}",
            prompt_field,
        )
    return InvalidRequest(
        f"max_tokens: {lengths} + max_tokens ({max_tokens}) exceeds the model's context of "
        f"{max_len} tokens; allowed: max_tokens up to {max_len - prompt_len} for this prompt "
        f"(at most {max_len} tokens in total)",
        "max_tokens",
    )


@dataclass(frozen=True)
class Prepared:
    """A request ready to dispatch: its call, the name to echo as `model`, the resolved ref."""

    call: GenerateCall
    model: str
    adapter: AdapterRef | None

    def choices(self, n: int) -> list[Prepared]:
        """The n engine requests of `n` choices: choice i under its own request id (the
        engine keys aborts by id) and seed (`router.choices.choice_params`), all in one
        `group` (their replica computes their prompt's scores once); one choice is this
        request itself."""
        if n == 1:
            return [self]
        call = self.call
        return [
            dataclasses.replace(
                self,
                call=dataclasses.replace(
                    call,
                    request_id=f"{call.request_id}-{i}",
                    params=choice_params(call.params, i),
                    group=call.request_id,
                ),
            )
            for i in range(n)
        ]

    def again(self) -> Prepared:
        """The same request under a new request id (the engine keys aborts by id)."""
        call = dataclasses.replace(self.call, request_id=f"req-{uuid.uuid4().hex}")
        return dataclasses.replace(self, call=call)
