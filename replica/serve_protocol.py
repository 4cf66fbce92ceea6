"""What the ingress sends a replica deployment (torch-free, Ray-free)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lora_core.errors import AdapterVersionUnavailable, InvalidRequest
from lora_core.identity import AdapterRef
from replica.sampling_params import SamplingParams


def check_prompt_ids(ids: Sequence[int], vocab_size: int, field: str = "prompt") -> None:
    """Refuse token ids outside the vocabulary (InvalidRequest naming the first and the
    body field), as the ingress and the offline runner answer a token-id prompt and the
    ingress a /detokenize."""
    bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise InvalidRequest(
            f"{field}: token id {bad[0]!r} out of range; allowed: 0 <= id < {vocab_size}", field
        )


@dataclass(frozen=True)
class GenerateCall:
    """One generation request, routed by the LoRA-affinity router to one replica.

    request_id: unique id (engine abort and logs use it).
    prompt_token_ids: the tokenized prompt, [P] ints.
    params: how to sample.
    adapter: the resolved adapter version, or None for the base model.
    residency: (replica_id, "gpu" | "cpu") pairs the registry reported for the
        adapter at resolution time; the request router reads them as hints.
    group: the id shared by the `n` choices of one request (None for n = 1); the
        request router keeps a group on one replica (`router.ranking`).
    cache_salt: the prefix-cache salt (`LLMEngine.add_request`): the tenant, and the
        request's own `cache_salt`, as the ingress's `prefix_cache_scope` says.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    adapter: AdapterRef | None = None
    residency: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    group: str | None = None
    cache_salt: str = ""

    @property
    def adapter_key(self) -> str | None:
        return None if self.adapter is None else self.adapter.key


def check_version(ref: AdapterRef, newest: dict[str, int]) -> None:
    """Refuse `ref` if this replica knows a newer version of its name; else record it.

    newest: adapter name -> the highest version this replica has seen (from requests
    and the registry's desired state). A request resolved just before its adapter was
    re-registered arrives with the old version: the retryable refusal makes the
    ingress resolve the name again instead of serving stale weights.
    """
    known = newest.get(ref.name, 0)
    if ref.version < known:
        raise AdapterVersionUnavailable(
            f"adapter {ref.name!r} version {ref.version} was replaced by version {known}; "
            "resolve the name again"
        )
    newest[ref.name] = ref.version
