"""ModelConfig.from_hf: what transformers' config and modeling code build from a
config.json (Qwen3's head_dim, attention_bias, q/k norms, sliding layers; each class's
rms_norm_eps default)."""

from __future__ import annotations

import pytest

from replica.models.config import ModelConfig

BASE = {
    "vocab_size": 384,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
}


def _cfg(arch: str, **extra) -> ModelConfig:
    return ModelConfig.from_hf({**BASE, "architectures": [arch], **extra})


@pytest.mark.parametrize(
    ("arch", "extra", "head_dim"),
    [
        ("Qwen3ForCausalLM", {}, 128),  # Qwen3Config's default, not hidden/heads
        ("Qwen3ForCausalLM", {"head_dim": 24}, 24),
        ("Qwen2ForCausalLM", {}, 16),
        ("LlamaForCausalLM", {}, 16),
    ],
)
def test_head_dim(arch, extra, head_dim) -> None:
    cfg = _cfg(arch, **extra)
    assert cfg.head_dim == cfg.base_shape.head_dim == head_dim


@pytest.mark.parametrize(
    ("arch", "extra", "qkv_bias", "o_bias", "qk_norm"),
    [
        ("Qwen3ForCausalLM", {}, False, False, True),
        ("Qwen3ForCausalLM", {"attention_bias": True}, True, True, True),
        ("Qwen2ForCausalLM", {}, True, False, False),
        ("LlamaForCausalLM", {}, False, False, False),
    ],
)
def test_attention_bias_and_qk_norm(arch, extra, qkv_bias, o_bias, qk_norm) -> None:
    cfg = _cfg(arch, **extra)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.qk_norm) == (qkv_bias, o_bias, qk_norm)


@pytest.mark.parametrize(
    ("extra", "windows"),
    [
        ({}, (None, None, None)),  # use_sliding_window false by default
        ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, (None, 8, 8)),
        (
            {
                "use_sliding_window": True,
                "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            },
            (8, None, 8),
        ),
        ({"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 0}, (None,) * 3),
    ],
)
def test_qwen3_sliding_layers(extra, windows) -> None:
    assert _cfg("Qwen3ForCausalLM", **extra).layer_windows == windows


@pytest.mark.parametrize(
    ("arch", "model_type"),
    [
        ("LlamaForCausalLM", "llama"),
        ("MistralForCausalLM", "mistral"),
        ("MixtralForCausalLM", "mixtral"),
        ("Qwen2ForCausalLM", "qwen2"),
        ("Qwen3ForCausalLM", "qwen3"),
        ("Qwen2MoeForCausalLM", "qwen2_moe"),
        ("Qwen3MoeForCausalLM", "qwen3_moe"),
    ],
)
def test_a_config_without_rms_norm_eps_takes_its_class_default(arch, model_type):
    """transformers fills a missing rms_norm_eps from the config class (a Mixtral's 1e-5)."""
    import transformers

    hf = transformers.AutoConfig.for_model(model_type)
    moe = {"num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2}
    moe |= {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
    extra = moe if arch.endswith(("MoeForCausalLM", "MixtralForCausalLM")) else {}
    assert _cfg(arch, **extra).rms_norm_eps == hf.rms_norm_eps
