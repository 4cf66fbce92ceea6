"""Typed view of a Llama-family HF config.json (what our model code reads)."""

from __future__ import annotations

from dataclasses import dataclass

from lora_core.base_shape import SUPPORTED_ARCHITECTURES, BaseShape
from lora_core.errors import ModelLoadFailed


@dataclass(frozen=True)
class ModelConfig:
    """architecture: LlamaForCausalLM | MistralForCausalLM | Qwen2ForCausalLM.

    qkv_bias: Qwen2 has biases on q/k/v. sliding_window: Mistral-style local attention
    (None = full attention). rope_scaling: None or the "llama3" scaling dict.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        shape = BaseShape.from_hf_config(cfg)
        arch = shape.architecture
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelLoadFailed(f"hidden_act={cfg.get('hidden_act')!r}; allowed: 'silu'")
        scaling = cfg.get("rope_scaling") or None
        rope_theta = float(
            cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        )
        if scaling is not None:
            kind = scaling.get("rope_type") or scaling.get("type")
            if kind == "default":
                scaling = None
            elif kind != "llama3":
                raise ModelLoadFailed(
                    f"rope_scaling type {kind!r}; allowed: none, 'default' or 'llama3'"
                )
        window = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            window = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=shape.hidden,
            intermediate_size=shape.intermediate,
            num_layers=shape.num_layers,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM",
            sliding_window=int(window) if window else None,
            eos_token_ids=eos_ids,
        )

    @property
    def base_shape(self) -> BaseShape:
        return BaseShape(
            architecture=self.architecture,
            num_layers=self.num_layers,
            hidden=self.hidden_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate=self.intermediate_size,
        )


__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES"]
