"""Adapter admission for the catalog: lora_core's torch-free PEFT validation."""

from __future__ import annotations

from lora_core.base_shape import BaseShape
from lora_core.validate import AdapterManifest, validate_adapter_dir


def validate_for_registry(path: str, max_lora_rank: int, base: BaseShape | None) -> AdapterManifest:
    """Validate the PEFT directory at path exactly as the engine does (same refusals and
    messages: DoRA, bias, modules_to_save, missing/corrupt files, pickle weights, rank
    over max_lora_rank, shapes not fitting base when given). Reads files, writes nothing."""
    return validate_adapter_dir(path, max_rank=max_lora_rank, base=base)
