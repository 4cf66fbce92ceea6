"""Bodies of the admin endpoints (vLLM-compatible adapter load / unload, and lorafleet's
pin / unpin / warm), validated once as the inference bodies are (`parse_body`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, Field

from cluster.keys import check_name
from router.openai_protocol import BODY_CONFIG


def _adapter_name(name: str) -> str:
    return check_name("adapter", name)


def _tenant_name(name: str | None) -> str | None:
    return name if name is None else check_name("tenant", name)


def _path_text(path: str) -> str:
    # A NUL cannot be in a file name; os.stat would refuse it later without naming the field.
    if "\x00" in path:
        raise ValueError(
            f"contains a NUL character at index {path.index(chr(0))}; allowed: an absolute "
            "path to a local directory"
        )
    return path


class LoadAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM-compatible body); names follow the registry's rule."""

    model_config = BODY_CONFIG

    lora_name: Annotated[str, AfterValidator(_adapter_name)]
    lora_path: Annotated[str, Field(min_length=1), AfterValidator(_path_text)]
    base_model: str | None = None
    tenant: Annotated[str | None, AfterValidator(_tenant_name)] = None
    """The owning tenant (it must exist); null: no owner (with replace: keep the owner)."""
    public: bool | None = None
    """Any tenant may use it; null: private (with replace: keep the current setting)."""
    replace: bool = False


class UnloadAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM-compatible body)."""

    model_config = BODY_CONFIG

    lora_name: str = Field(min_length=1)
    lora_path: str | None = None


class AdapterNameRequest(BaseModel):
    """POST /v1/pin_lora_adapter, /v1/unpin_lora_adapter."""

    model_config = BODY_CONFIG

    lora_name: str = Field(min_length=1)


class WarmAdapterRequest(AdapterNameRequest):
    """POST /v1/warm_lora_adapter."""

    replicas: int
    """On how many replicas to keep the adapter GPU-resident; 0 clears the target (the
    registry checks the range, so REST and the CLI agree)."""
