"""The model shapes `benchmarks/engine_gpu.py` times (`--shape`), and the weight bytes a
decode step of each reads.

llama: Llama-3-8B (32 layers, dense MLP of I 14336); adapters on all seven projections.
mixtral: Mixtral-8x7B (H 4096, 8 experts of I 14336 per layer, top-2 routing, 32 query /
8 kv heads, vocab 32000, rope_theta 1e6); adapters on q/k/v/o only, as lorafleet serves
every mixture-of-experts model (`BaseShape.lora_groups`). 8 layers by default: their
experts are 8 x 8 x 3 x 4096 x 14336 x 2 B = 22.5 GB of bf16, and the model is built in
float32 first (5.6 GB a layer at that peak, 45 GB for 8).

A decode step of T tokens reads each MoE layer's experts only where some token is
routed: with each token's top-k a uniformly random k of the E experts (what random router
weights give, roughly), an expert is missed by one token with probability 1 - k/E, so a
layer touches E x (1 - (1 - k/E)^T) distinct experts in expectation
(`expected_experts`): 2 of 8 at T = 1, 7.2 at T = 8, all 8 to within 1e-15 at T = 128.
"""

from __future__ import annotations

from torch import nn

from replica.models.moe import COMPUTE_PATHS, SparseMoE

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "eos_token_id": 128001,
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e6,
    "max_position_embeddings": 32768,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}
SHAPES = {"llama": LLAMA3_8B, "mixtral": MIXTRAL_8X7B}
MODEL_NAMES = {
    "llama": "Llama-3-8B shape, random bf16 weights",
    "mixtral": "Mixtral-8x7B shape, random bf16 weights",
}
DEFAULT_LAYERS = {"llama": 32, "mixtral": 8}
# --smoke: tiny sizes on the CPU (a mixtral keeps its 8 experts, top-2)
SMOKE = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts T tokens reach in expectation, each routed to a uniformly random
    top_k of num_experts: E x (1 - (1 - k/E)^T). Example: E 8, k 2, T 2 -> 3.5."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def _expert_modules(model: nn.Module) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def step_weight_bytes(model: nn.Module, tokens: int) -> int | float:
    """Weight bytes one decode step of `tokens` tokens reads: every parameter (tied ones
    once) but the routed experts, plus each MoE layer's `expected_experts` whole experts
    (gate, up and down rows). A model without MoE layers: all its parameters (an int)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    routed = 0
    for moe in _expert_modules(model):
        ex = moe.experts
        nbytes = sum(p.numel() * p.element_size() for p in (ex.gate_up_proj, ex.down_proj))
        hit = expected_experts(ex.num_experts, moe.gate.top_k, tokens)
        total -= nbytes
        routed += nbytes / ex.num_local * hit
    return total + routed


def set_moe_path(model: nn.Module, path: str) -> None:
    """Every MoE block's `SparseMoE.compute` := path (one of COMPUTE_PATHS)."""
    if path not in COMPUTE_PATHS:
        raise ValueError(f"moe path {path!r}; allowed: {', '.join(COMPUTE_PATHS)}")
    for moe in _expert_modules(model):
        moe.compute = path
