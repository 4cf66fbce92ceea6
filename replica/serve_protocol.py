"""What the ingress sends a replica deployment (torch-free, Ray-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lora_core.identity import AdapterRef
from replica.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerateCall:
    """One generation request, routed by the LoRA-affinity router to one replica.

    request_id: unique id (engine abort and logs use it).
    prompt_token_ids: the tokenized prompt, [P] ints.
    params: how to sample.
    adapter: the resolved adapter version, or None for the base model.
    residency: (replica_id, "gpu" | "cpu") pairs the registry reported for the
        adapter at resolution time; the request router reads them as hints.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    adapter: AdapterRef | None = None
    residency: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    @property
    def adapter_key(self) -> str | None:
        return None if self.adapter is None else self.adapter.key
