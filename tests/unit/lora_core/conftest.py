"""Tiny models and real PEFT adapters for lora_core tests (built in-process, no hub)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from lora_core.base_shape import BaseShape

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=256,
)


def tiny_model(arch: str = "llama", seed: int = 0) -> torch.nn.Module:
    """A randomly initialised 2-layer Llama or Qwen2 (hidden 64, 4 heads, 2 kv heads)."""
    torch.manual_seed(seed)
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**TINY)).eval()
    return LlamaForCausalLM(LlamaConfig(**TINY)).eval()


def tiny_base(arch: str = "llama") -> BaseShape:
    cfg = (Qwen2Config if arch == "qwen2" else LlamaConfig)(**TINY).to_dict()
    cfg["architectures"] = ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"]
    return BaseShape.from_hf_config(cfg)


def build_peft_model(arch: str = "llama", seed: int = 0, lora_seed: int = 1, **lora: object):
    """A PeftModel with random (non-zero) lora_A and lora_B; `seed` fixes the base weights."""
    lora.setdefault("r", 4)
    lora.setdefault("lora_alpha", 8)
    lora.setdefault("target_modules", ["q_proj", "v_proj"])
    base_model = tiny_model(arch, seed)
    torch.manual_seed(lora_seed)
    model = get_peft_model(base_model, LoraConfig(init_lora_weights=False, **lora))
    return model.eval()


def save_adapter(
    path: Path, arch: str = "llama", seed: int = 0, lora_seed: int = 1, **lora: object
) -> Path:
    """Build a PEFT adapter with random weights and save_pretrained it under `path`."""
    model = build_peft_model(arch, seed, lora_seed, **lora)
    model.save_pretrained(str(path))
    return path


@pytest.fixture
def make_adapter(tmp_path: Path) -> Callable[..., Path]:
    """make_adapter(name="a", arch="llama", seed=0, lora_seed=1, **LoraConfig kwargs) -> dir."""

    def make(
        name: str = "a", arch: str = "llama", seed: int = 0, lora_seed: int = 1, **lora: object
    ) -> Path:
        return save_adapter(tmp_path / name, arch, seed, lora_seed, **lora)

    return make


@pytest.fixture
def base() -> BaseShape:
    return tiny_base("llama")


@pytest.fixture
def build_peft() -> Callable[..., torch.nn.Module]:
    """build_peft(arch="llama", seed=0, lora_seed=1, **LoraConfig kwargs) -> PeftModel."""
    return build_peft_model
