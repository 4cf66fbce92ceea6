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


def base_model_note(path: str, served_id: str) -> str | None:
    """A note when the adapter config at path names a base model other than served_id,
    the model this cluster serves (None when it names none, the same one, or one whose last
    path component is served_id: "meta-llama/Llama-3-8B" is "Llama-3-8B", case aside).

    Registration takes such an adapter when its shapes fit the served model, as vLLM and
    LoRAX do: names are not reliable (served_model_name can be any alias, a base model
    moves between directories). But an adapter trained on another model of the same shapes
    (Llama-3 on Llama-3.1) loads and answers without error, and only its users would see
    the damage, so the operator hears of it when it is registered."""
    try:
        named = config_base_model(path)
    except Exception:  # the registration has read it: a config gone since is not worth a note
        return None
    if not named or _same_model(named, served_id):
        return None
    return (
        f"the adapter's config names base model {named!r}; this cluster serves "
        f"{served_id!r}. Its shapes fit, so it was registered as adapting {served_id!r}: "
        "check that it was trained on this model (an adapter trained on another model "
        "of the same shapes loads and answers, but not as it was trained to)"
    )


def _same_model(named: str, served_id: str) -> bool:
    def last(name: str) -> str:
        return name.rstrip("/").rsplit("/", 1)[-1].casefold()

    return named.casefold() == served_id.casefold() or last(named) == last(served_id)
