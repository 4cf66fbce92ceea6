"""Saved LoRA tensor names back to module keys, supported modules or not."""

from __future__ import annotations

import pytest

from lora_core.module_names import parse_tensor_name, tensor_module_key


@pytest.mark.parametrize(
    ("name", "key", "parsed"),
    [
        ("base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight",
         "model.layers.3.self_attn.q_proj", (3, "q_proj", "A")),
        ("base_model.model.model.layers.12.mlp.experts.7.down_proj.lora_B.weight",
         "model.layers.12.mlp.experts.7.down_proj", None),
        ("base_model.model.model.layers.0.block_sparse_moe.experts.1.w3.lora_A.weight",
         "model.layers.0.block_sparse_moe.experts.1.w3", None),
        ("model.layers.3.self_attn.q_proj.lora_A.weight", None, None),  # no PEFT prefix
        ("base_model.model.model.layers.3.self_attn.q_proj.weight", None, None),  # not LoRA
        ("base_model.model.model.layers.3.mlp.experts.lora_A.weight",
         "model.layers.3.mlp.experts", None),
    ],
)  # fmt: skip
def test_tensor_module_key(name, key, parsed):
    assert tensor_module_key(name) == key
    assert parse_tensor_name(name) == parsed
