"""Module names of the Llama family as PEFT sees them (torch-free).

PEFT matches `target_modules`, `rank_pattern` and `alpha_pattern` against the keys of
the *transformers* model's `named_modules()`, e.g. "model.layers.3.self_attn.q_proj";
saved tensors add the PeftModel prefix and the LoRA parameter:
"base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight".
"""

from __future__ import annotations

import re

from lora_core.base_shape import MODULES

PEFT_PREFIX = "base_model.model."
PARENT: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_KEY_RE = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)")
_TENSOR_RE = re.compile(r"(?P<key>.+)\.lora_(?P<ab>[AB])\.weight")
# Every other module a Llama/Mistral/Qwen2/Qwen3 model has (Qwen3's per-head q/k norms
# included): targets may not match these (a mixture-of-experts model's MLP side: moe_keys).
_TOP_LEVEL = (
    "model",
    "model.embed_tokens",
    "model.layers",
    "model.norm",
    "model.rotary_emb",
    "lm_head",
)
_PER_LAYER = (
    "",
    ".self_attn",
    ".self_attn.q_norm",
    ".self_attn.k_norm",
    ".mlp",
    ".mlp.act_fn",
    ".input_layernorm",
    ".post_attention_layernorm",
)


def module_key(layer: int, module: str) -> str:
    """(3, "q_proj") -> "model.layers.3.self_attn.q_proj"."""
    return f"model.layers.{layer}.{PARENT[module]}.{module}"


def strip_peft_prefix(name: str) -> str:
    """Accept both "base_model.model.model.layers..." and "model.layers..."."""
    return name.removeprefix(PEFT_PREFIX)


def parse_module_key(key: str) -> tuple[int, str] | None:
    """ "model.layers.3.self_attn.q_proj" -> (3, "q_proj"); None for anything unsupported."""
    m = _KEY_RE.fullmatch(strip_peft_prefix(key))
    if m is None or m.group(3) not in PARENT or PARENT[m.group(3)] != m.group(2):
        return None
    return int(m.group(1)), m.group(3)


def parse_tensor_name(name: str) -> tuple[int, str, str] | None:
    """ "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight" -> (3, "q_proj", "A")."""
    m = _TENSOR_RE.fullmatch(name)
    if m is None or not m.group("key").startswith(PEFT_PREFIX):
        return None
    parsed = parse_module_key(m.group("key"))
    if parsed is None:
        return None
    return parsed[0], parsed[1], m.group("ab")


def tensor_module_key(name: str) -> str | None:
    """ "base_model.model.model.layers.3.mlp.experts.0.down_proj.lora_A.weight" ->
    "model.layers.3.mlp.experts.0.down_proj", of any module (supported or not); None for
    a name that is not a saved LoRA weight."""
    m = _TENSOR_RE.fullmatch(name)
    if m is None or not m.group("key").startswith(PEFT_PREFIX):
        return None
    return strip_peft_prefix(m.group("key"))


def supported_keys(num_layers: int, modules: tuple[str, ...] = MODULES) -> list[str]:
    """The keys of every adaptable projection of a num_layers-layer model (modules: the
    base's adaptable names, BaseShape.lora_modules)."""
    return [module_key(i, m) for i in range(num_layers) for m in modules]


def moe_keys(num_layers: int, num_experts: int, architecture: str) -> list[str]:
    """The MLP-side keys of a mixture-of-experts model that no LoRA may target, per layer
    transformers >= 5's names first: the router (mlp.gate) and fused experts
    (mlp.experts), Qwen2-MoE's shared expert (mlp.shared_expert and its projections,
    mlp.shared_expert_gate), the dense projections mlp.gate_proj/up_proj/down_proj (a
    Qwen MoE's mlp_only_layers; a Mixtral has none, a same-sized Llama adapter's would
    target them); then the older per-expert names (Mixtral: block_sparse_moe.gate,
    block_sparse_moe.experts.<e>.w1/w2/w3; Qwen: mlp.experts.<e>.gate_proj/up_proj/down_proj)."""
    dense = ("gate_proj", "up_proj", "down_proj")
    keys = []
    for i in range(num_layers):
        mlp = f"model.layers.{i}.mlp"
        keys += [f"{mlp}.gate", f"{mlp}.experts"]
        if architecture == "Qwen2MoeForCausalLM":
            shared = f"{mlp}.shared_expert"
            keys += [shared, f"{shared}_gate"] + [f"{shared}.{m}" for m in dense]
        keys += [f"{mlp}.{m}" for m in dense]
        if architecture == "MixtralForCausalLM":
            moe = f"model.layers.{i}.block_sparse_moe"
            keys += [moe, f"{moe}.gate", f"{moe}.experts"]
            for e in range(num_experts):
                keys += [f"{moe}.experts.{e}"] + [f"{moe}.experts.{e}.w{j}" for j in (1, 2, 3)]
        else:
            for e in range(num_experts):
                keys += [f"{mlp}.experts.{e}"] + [f"{mlp}.experts.{e}.{m}" for m in dense]
    return keys


def unsupported_keys(num_layers: int) -> list[str]:
    """Every other module key of a Llama-family model (embeddings, norms, lm_head, ...)."""
    per_layer = [f"model.layers.{i}{suffix}" for i in range(num_layers) for suffix in _PER_LAYER]
    return list(_TOP_LEVEL) + per_layer
