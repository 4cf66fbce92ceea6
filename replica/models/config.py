"""Typed view of a Llama-family (Llama, Mistral, Qwen2, Qwen3) or Mixtral HF config.json
(what our model code reads)."""

from __future__ import annotations

from dataclasses import dataclass

from lora_core.base_shape import SUPPORTED_ARCHITECTURES, BaseShape
from lora_core.errors import InvalidRequest, ModelLoadFailed
from replica.models.rope_config import RopeScaling, read_rope

# transformers' LlamaConfig leaves it 2048 and MistralConfig 4096*32; a config.json saved
# by transformers always names it, so this only fills in a hand-written one.
DEFAULT_MAX_POSITIONS = 4096


def max_positions(cfg: dict) -> int:
    """The model's native context length from its config.json: max_position_embeddings,
    or with yarn RoPE scaling original_max_position_embeddings x factor where that is more
    (`RopeScaling.context_length`)."""
    native = int(cfg.get("max_position_embeddings", DEFAULT_MAX_POSITIONS))
    scaling = read_rope(cfg)[1]
    return scaling.context_length(native) if scaling else native


def resolve_max_model_len(configured: int, native: int) -> int:
    """The context length served: configured (0 = the model's native length).

    More than the model's context length (`max_positions`) is refused, as vLLM refuses
    it: positions past what the model was trained on (and its RoPE scaling covers) give
    wrong outputs, and clamping silently would serve less than the operator asked.
    """
    if configured > native:
        raise InvalidRequest(
            f"max_model_len={configured} exceeds the model's context length={native} (its "
            "max_position_embeddings, or with yarn RoPE scaling original_max_position_embeddings"
            f" x factor where more); allowed: 1..{native}, or 0 for the model's length"
        )
    return configured or native


@dataclass(frozen=True)
class ModelConfig:
    """architecture: LlamaForCausalLM | MistralForCausalLM | Qwen2ForCausalLM |
    Qwen3ForCausalLM | MixtralForCausalLM.

    qkv_bias: Qwen2 has biases on q/k/v; Qwen3 on q/k/v and o when its attention_bias
    is set (o_bias). qk_norm: Qwen3 RMS-normalises each head's q and k (weights of
    head_dim) after the projection, before RoPE. layer_windows: each layer's
    local-attention window (None = full attention), as transformers applies it: every
    Mistral layer; Qwen2 and Qwen3 layers from max_window_layers on (or those
    layer_types calls sliding) when use_sliding_window; never Llama. rope_scaling: None
    (plain RoPE) or how the frequencies are scaled (linear, llama3, yarn).
    max_position_embeddings: the context served at most (`max_positions`: yarn's
    original x factor where that is more than config.json's).
    num_experts: Mixtral's num_local_experts (0: a dense MLP); num_experts_per_tok: the
    experts each token is routed to (0 when dense); intermediate_size is then each
    expert's.
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
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    layer_windows: tuple[int | None, ...]
    eos_token_ids: tuple[int, ...]
    num_experts: int
    num_experts_per_tok: int

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        shape = BaseShape.from_hf_config(cfg)
        arch = shape.architecture
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelLoadFailed(f"hidden_act={cfg.get('hidden_act')!r}; allowed: 'silu'")
        rope_theta, scaling = read_rope(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        qwen3_bias = arch == "Qwen3ForCausalLM" and bool(cfg.get("attention_bias", False))
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
            max_position_embeddings=max_positions(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or qwen3_bias,
            o_bias=qwen3_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            layer_windows=_layer_windows(cfg, arch, shape.num_layers),
            eos_token_ids=eos_ids,
            num_experts=shape.num_experts,
            num_experts_per_tok=_experts_per_tok(cfg, shape.num_experts),
        )

    def check_tensor_parallel(self, size: int) -> None:
        """Refuse a tensor_parallel_size the model cannot be sharded over (Megatron TP
        splits q heads, kv heads and the MLP's intermediate features evenly; expert
        parallelism gives each rank an equal number of whole experts instead)."""
        dims = {
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
        }
        if self.num_experts:
            dims["num_local_experts"] = self.num_experts
        else:
            dims["intermediate_size"] = self.intermediate_size
        for name, n in dims.items():
            if n % size:
                raise InvalidRequest(
                    f"{name}={n} is not divisible by tensor_parallel_size={size}; allowed: a "
                    f"tensor_parallel_size dividing {', '.join(f'{k}={v}' for k, v in dims.items())}"
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
            num_experts=self.num_experts,
        )


def _experts_per_tok(cfg: dict, num_experts: int) -> int:
    """num_experts_per_tok of a mixture-of-experts config (0 for a dense one), refused
    unless 1..num_experts."""
    if not num_experts:
        return 0
    k = int(cfg.get("num_experts_per_tok", 2))  # MixtralConfig's default
    if not 1 <= k <= num_experts:
        raise ModelLoadFailed(
            f"num_experts_per_tok={k}; allowed: 1..num_local_experts={num_experts}"
        )
    return k


def _layer_windows(cfg: dict, arch: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window, following transformers' modeling code: Llama has none
    (a sliding_window key is ignored); Mistral and Mixtral slide every layer; Qwen2 and
    Qwen3 slide only with use_sliding_window, and then only the layers its layer_types
    marks "sliding_attention" (by default those from max_window_layers on, so applying
    the window to every layer diverged from transformers)."""
    if arch == "LlamaForCausalLM":
        return (None,) * num_layers
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        window = cfg.get("sliding_window")
        return (int(window) if window else None,) * num_layers
    window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
    if not window:
        return (None,) * num_layers
    types = cfg.get("layer_types")
    if types is None:
        first = int(cfg.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ModelLoadFailed(
            f"layer_types={types!r}; allowed: {num_layers} entries of 'full_attention' or "
            "'sliding_attention'"
        )
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES"]
