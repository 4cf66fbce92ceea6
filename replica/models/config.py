"""Typed view of a Llama-family (Llama, Mistral, Qwen2, Qwen3) or mixture-of-experts
(Mixtral, Qwen2-MoE, Qwen3-MoE) HF config.json (what our model code reads)."""

from __future__ import annotations

from dataclasses import dataclass

from lora_core.base_shape import (
    EXPERTS_FIELD,
    QWEN_MOE_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    BaseShape,
)
from lora_core.errors import InvalidRequest, ModelLoadFailed
from replica.models.rope_config import RopeScaling, read_rope

# transformers' LlamaConfig leaves it 2048 and MistralConfig 4096*32; a config.json saved
# by transformers always names it, so this only fills in a hand-written one.
DEFAULT_MAX_POSITIONS = 4096
# num_experts_per_tok of a config.json that leaves it out: its config class's default.
_DEFAULT_TOP_K = {"MixtralForCausalLM": 2, "Qwen2MoeForCausalLM": 4, "Qwen3MoeForCausalLM": 8}
# rms_norm_eps of a config.json that leaves it out: its config class's default (1e-6 but
# for Mixtral's).
_DEFAULT_EPS = {"MixtralForCausalLM": 1e-5}


def max_positions(cfg: dict) -> int:
    """The model's native context length from its config.json: max_position_embeddings,
    stretched by RoPE scaling as vLLM stretches it (`RopeScaling.context_length`): x factor
    for linear, original_max_position_embeddings x factor for yarn where that is more.
    ModelLoadFailed when that leaves no position (e.g. a linear factor of 0.0001): the
    model would load and then refuse every request."""
    native = int(cfg.get("max_position_embeddings", DEFAULT_MAX_POSITIONS))
    scaling = read_rope(cfg)[1]
    length = scaling.context_length(native) if scaling else native
    if length < 1:
        stretch = f" x RoPE factor {scaling.factor}" if scaling else ""
        raise ModelLoadFailed(
            f"max_position_embeddings={native}{stretch} leaves a context of {length} "
            "positions; allowed: at least 1"
        )
    return length


def resolve_max_model_len(configured: int, native: int) -> int:
    """The context length served: configured (0 = the model's native length).

    More than the model's context length (`max_positions`) is refused, as vLLM refuses
    it: positions past what the model was trained on (and its RoPE scaling covers) give
    wrong outputs, and clamping silently would serve less than the operator asked.
    """
    if configured > native:
        raise InvalidRequest(
            f"max_model_len={configured} exceeds the model's context length={native} (its "
            "max_position_embeddings, x factor with linear RoPE scaling, or with yarn "
            "original_max_position_embeddings x factor where more); allowed: "
            f"1..{native}, or 0 for the model's length"
        )
    return configured or native


@dataclass(frozen=True)
class ModelConfig:
    """architecture: LlamaForCausalLM | MistralForCausalLM | Qwen2ForCausalLM |
    Qwen3ForCausalLM | MixtralForCausalLM | Qwen2MoeForCausalLM | Qwen3MoeForCausalLM.

    qkv_bias: Qwen2 has biases on q/k/v (Qwen2-MoE unless its qkv_bias is false); Qwen3
    and Qwen3-MoE on q/k/v and o when their attention_bias is set (o_bias). qk_norm:
    Qwen3 and Qwen3-MoE RMS-normalise each head's q and k (weights of head_dim) after the
    projection, before RoPE. layer_windows: each layer's
    local-attention window (None = full attention), as transformers applies it: every
    Mistral layer; Qwen2 and Qwen3 layers from max_window_layers on (or those
    layer_types calls sliding) when use_sliding_window; Qwen2-MoE the layers its
    layer_types marks (by default the even ones below max_window_layers) and Qwen3-MoE
    every layer when use_sliding_window; never Llama. rope_scaling: None
    (plain RoPE) or how the frequencies are scaled (linear, llama3, yarn).
    max_position_embeddings: the context served at most (`max_positions`: x factor for
    linear RoPE scaling, yarn's original x factor where that is more than config.json's).
    num_experts: the experts of each mixture-of-experts layer (Mixtral's num_local_experts,
    a Qwen MoE's num_experts; 0: a dense model); num_experts_per_tok: the experts each
    token is routed to (0 when dense). moe_layers: which layers are sparse MoE blocks (the
    others dense MLPs of intermediate_size: a Qwen MoE's mlp_only_layers, and the layers
    decoder_sparse_step skips). moe_intermediate_size: each expert's intermediate size
    (Mixtral's intermediate_size; 0 when dense). norm_topk_prob: the top-k routing
    weights are renormalised to sum to 1 (always for Mixtral). moe_weights_cast: the
    routing weights are rounded to the model's dtype before they scale the experts'
    outputs (Qwen MoE routers; Mixtral's stay float32). shared_expert_intermediate_size:
    Qwen2-MoE's shared expert, a dense MLP every token takes, gated by
    sigmoid(shared_expert_gate(x)) (0: none).
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
    moe_layers: tuple[bool, ...]
    moe_intermediate_size: int
    norm_topk_prob: bool
    moe_weights_cast: bool
    shared_expert_intermediate_size: int

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        shape = BaseShape.from_hf_config(cfg)
        arch = shape.architecture
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelLoadFailed(f"hidden_act={cfg.get('hidden_act')!r}; allowed: 'silu'")
        rope_theta, scaling = read_rope(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        qwen3 = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        qwen3_bias = qwen3 and bool(cfg.get("attention_bias", False))
        qwen2_bias = arch == "Qwen2ForCausalLM" or (
            arch == "Qwen2MoeForCausalLM" and bool(cfg.get("qkv_bias", True))
        )
        experts = shape.num_experts
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=shape.hidden,
            intermediate_size=shape.intermediate,
            num_layers=shape.num_layers,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", _DEFAULT_EPS.get(arch, 1e-6))),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=max_positions(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qwen2_bias or qwen3_bias,
            o_bias=qwen3_bias,
            qk_norm=qwen3,
            layer_windows=_layer_windows(cfg, arch, shape.num_layers),
            eos_token_ids=eos_ids,
            num_experts=experts,
            num_experts_per_tok=_experts_per_tok(cfg, arch, experts),
            moe_layers=shape.moe_layers,
            moe_intermediate_size=_moe_size(cfg, arch, "moe_intermediate_size") if experts else 0,
            norm_topk_prob=arch == "MixtralForCausalLM" or bool(cfg.get("norm_topk_prob", False)),
            moe_weights_cast=arch in QWEN_MOE_ARCHITECTURES,
            shared_expert_intermediate_size=(
                _moe_size(cfg, arch, "shared_expert_intermediate_size")
                if arch == "Qwen2MoeForCausalLM"
                else 0
            ),
        )

    def check_tensor_parallel(self, size: int) -> None:
        """Refuse a tensor_parallel_size the model cannot be sharded over (Megatron TP
        splits q heads, kv heads and a dense MLP's intermediate features evenly (a Qwen2-MoE's
        shared expert's too); expert parallelism gives each rank an equal number of whole
        experts instead)."""
        dims = {
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
        }
        if self.num_experts:
            dims[EXPERTS_FIELD[self.architecture]] = self.num_experts
        if not all(self.moe_layers):
            dims["intermediate_size"] = self.intermediate_size
        if self.shared_expert_intermediate_size:
            dims["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
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
            moe_layers=self.moe_layers,
        )


def _experts_per_tok(cfg: dict, arch: str, num_experts: int) -> int:
    """num_experts_per_tok of a mixture-of-experts config (0 for a dense one), refused
    unless 1..num_experts."""
    if not num_experts:
        return 0
    k = int(cfg.get("num_experts_per_tok", _DEFAULT_TOP_K[arch]))
    if not 1 <= k <= num_experts:
        raise ModelLoadFailed(
            f"num_experts_per_tok={k}; allowed: 1..{EXPERTS_FIELD[arch]}={num_experts}"
        )
    return k


def _moe_size(cfg: dict, arch: str, field: str) -> int:
    """A MoE intermediate size (Mixtral: intermediate_size), refused unless >= 1."""
    field = "intermediate_size" if arch == "MixtralForCausalLM" else field
    value = cfg[field]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadFailed(f"{field}={value!r}; allowed: an integer >= 1 for {arch}")
    return value


def _layer_windows(cfg: dict, arch: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window, following transformers' modeling code: Llama has none
    (a sliding_window key is ignored); Mistral and Mixtral slide every layer; Qwen2 and
    Qwen3 slide only with use_sliding_window, and then only the layers its layer_types
    marks "sliding_attention" (by default those from max_window_layers on, so applying
    the window to every layer diverged from transformers); Qwen2-MoE likewise, its
    default the even layers below max_window_layers; Qwen3-MoE (no layer_types) every
    layer with use_sliding_window."""
    if arch == "LlamaForCausalLM":
        return (None,) * num_layers
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        window = cfg.get("sliding_window")
        return (int(window) if window else None,) * num_layers
    window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
    if not window:
        return (None,) * num_layers
    if arch == "Qwen3MoeForCausalLM":
        return (int(window),) * num_layers
    types = cfg.get("layer_types")
    if types is None:
        last = int(cfg.get("max_window_layers", 28))
        types = [
            "sliding_attention" if _slides_by_default(arch, i, last) else "full_attention"
            for i in range(num_layers)
        ]
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ModelLoadFailed(
            f"layer_types={types!r}; allowed: {num_layers} entries of 'full_attention' or "
            "'sliding_attention'"
        )
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def _slides_by_default(arch: str, layer: int, max_window_layers: int) -> bool:
    """A Qwen2 / Qwen3 layer's default layer_type: sliding from max_window_layers on;
    a Qwen2-MoE's: the even layers below max_window_layers (its config class's rule)."""
    if arch == "Qwen2MoeForCausalLM":
        return layer % 2 == 0 and layer < max_window_layers
    return layer >= max_window_layers


__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES"]
