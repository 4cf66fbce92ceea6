"""cluster.catalog.base_model_note: when the adapter config names another base model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.catalog import base_model_note


def _config(tmp_path: Path, base: str | None) -> str:
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    if base is not None:
        cfg["base_model_name_or_path"] = base
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize(
    "named, served",
    [
        (None, "tiny"),
        ("", "tiny"),
        ("tiny", "tiny"),
        ("meta-llama/Meta-Llama-3-8B", "Meta-Llama-3-8B"),
        ("meta-llama/Meta-Llama-3-8B/", "meta-llama-3-8b"),
        ("/models/llama3", "llama3"),
        ("Meta-Llama-3-8B", "org/meta-llama-3-8B"),
    ],
)
def test_no_note_when_the_names_agree(tmp_path, named, served):
    assert base_model_note(_config(tmp_path, named), served) is None


@pytest.mark.parametrize(
    "named, served",
    [
        ("meta-llama/Meta-Llama-3.1-8B", "Meta-Llama-3-8B"),
        ("mistralai/Mistral-7B-v0.1", "llama3"),
        ("Meta-Llama-3-8B", "Meta-Llama-3-8B-Instruct"),
    ],
)
def test_a_note_names_both_models(tmp_path, named, served):
    note = base_model_note(_config(tmp_path, named), served)
    assert note is not None
    assert f"names base model {named!r}" in note
    assert f"this cluster serves {served!r}" in note


def test_no_note_without_a_readable_config(tmp_path):
    assert base_model_note(str(tmp_path / "gone"), "tiny") is None
    (tmp_path / "adapter_config.json").write_text("{not json")
    assert base_model_note(str(tmp_path), "tiny") is None
