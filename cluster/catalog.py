"""Adapter admission for the catalog: lora_core's PEFT validation plus the cluster max rank."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lora_core.base_shape import BaseShape

if TYPE_CHECKING:
    from lora_core.validate import AdapterManifest


def validate_for_registry(path: str, max_lora_rank: int, base: BaseShape | None) -> AdapterManifest:
    """Validate the PEFT directory at path exactly as the engine would (same refusals
    and messages: DoRA, bias, modules_to_save, missing/corrupt files, pickle weights,
    rank over max_lora_rank, shapes not fitting base when given). Reads files only."""
    from lora_core.validate import validate_adapter_dir

    return validate_adapter_dir(path, max_rank=max_lora_rank, base=base)
