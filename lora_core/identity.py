"""Adapter identity (torch-free).

A name is for people; identity is (name, version, content hash). Prefix-cache keys,
slot residency and routing all use `AdapterRef.key`, so re-registering a name with
new weights can never reuse stale KV blocks or a stale slot.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """An immutable reference to one version of one adapter.

    name: the adapter's public name (what clients put in `model`).
    version: bumped by the registry each time the name is re-registered (>= 1).
    content_hash: sha256 hex of adapter_config.json + weights, as computed by
        `lora_core.validate.content_hash`.
    path: local directory holding adapter_config.json + adapter_model.safetensors.
    rank: the largest LoRA rank of any module of the adapter.
    base_model: the base model id the adapter was trained for ("" if unknown).
    """

    name: str
    version: int
    content_hash: str
    path: str
    rank: int
    base_model: str = ""

    @property
    def key(self) -> str:
        """Identity string: unique per (name, version, content)."""
        return f"{self.name}@{self.version}:{self.content_hash[:16]}"
