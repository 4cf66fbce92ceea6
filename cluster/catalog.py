"""Adapter admission for the catalog: lora_core's torch-free PEFT validation."""

from __future__ import annotations

from pathlib import Path

from lora_core.base_shape import BaseShape
from lora_core.peft_config import LoraSpec
from lora_core.validate import CONFIG_FILE, AdapterManifest, validate_adapter_dir


def validate_for_registry(path: str, max_lora_rank: int, base: BaseShape | None) -> AdapterManifest:
    """Validate the PEFT directory at path exactly as the engine does (same refusals and
    messages: DoRA, bias, modules_to_save, missing/corrupt files, pickle weights, rank
    over max_lora_rank, shapes not fitting base when given). Reads files, writes nothing."""
    return validate_adapter_dir(path, max_rank=max_lora_rank, base=base)


def config_base_model(path: str) -> str | None:
    """base_model_name_or_path of the adapter config in the directory path (None if unset
    or there is no config to read: the registration then names what is wrong). Reads the
    config alone: validating twice read, hashed and scanned the weights twice."""
    config = Path(path).expanduser() / CONFIG_FILE
    if not path.strip() or not config.is_file():  # Path("") is the working directory
        return None
    return LoraSpec.from_file(config).base_model or None
