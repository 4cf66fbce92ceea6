"""The shapes of a base model that adapters must fit (torch-free, from config.json).

Module names are PEFT's: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj.
They pack into the model's fused layers as groups: qkv = (q, k, v), o = (o,),
gate_up = (gate, up), down = (down,). A mixture-of-experts model (Mixtral, Qwen2-MoE,
Qwen3-MoE) takes LoRA on its attention groups (qkv, o) only: its router, experts, Qwen2-MoE's
shared expert and the dense MLPs of a Qwen MoE's mlp_only_layers take none.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from lora_core.errors import ModelLoadFailed

GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
MODULES: tuple[str, ...] = tuple(m for mods in GROUPS.values() for m in mods)
MODULE_GROUP: dict[str, tuple[str, int]] = {
    m: (g, i) for g, mods in GROUPS.items() for i, m in enumerate(mods)
}
# Groups whose layer splits its *input* across tensor-parallel ranks (Megatron
# row-parallel: o, down); the others (qkv, gate_up) split their output (column-parallel).
ROW_PARALLEL_GROUPS: frozenset[str] = frozenset({"o", "down"})
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# The mixture-of-experts models some of whose layers may be dense MLPs (BaseShape.moe_layers).
QWEN_MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# The config.json field holding a mixture-of-experts model's expert count. transformers 5
# writes a Qwen3-MoE's under num_local_experts (its config's attribute_map), the hub's
# Qwen3-MoE checkpoints under num_experts: both are read.
EXPERTS_FIELD = {
    "MixtralForCausalLM": "num_local_experts",
    "Qwen2MoeForCausalLM": "num_experts",
    "Qwen3MoeForCausalLM": "num_experts",
}
# What of a mixture-of-experts model's MLP side takes no LoRA (refusals name it).
MOE_PARTS = {
    "MixtralForCausalLM": "router and experts",
    "Qwen2MoeForCausalLM": "router, experts, shared expert and dense MLP layers",
    "Qwen3MoeForCausalLM": "router, experts and dense MLP layers",
}
# A config.json without head_dim: hidden_size / num_attention_heads, except Qwen3, whose
# config class defaults it to 128 (what transformers then builds, whatever the hidden size).
_DEFAULT_HEAD_DIM = {"Qwen3ForCausalLM": 128}
ATTENTION_GROUPS: tuple[str, ...] = ("qkv", "o")


@dataclass(frozen=True)
class BaseShape:
    """num_layers decoder layers; each projection's (in_features, out_features).

    num_experts: 0 for a dense MLP; a mixture-of-experts model's expert count (its
    EXPERTS_FIELD); intermediate is then the config's intermediate_size (a Mixtral's
    experts', a Qwen MoE's dense MLP layers'), which no adapter reaches. Defaults to 0 so
    records stored before it existed still read.
    moe_layers: per layer, whether it is a sparse MoE block, as transformers builds it:
    every Mixtral layer; a Qwen MoE's layer i unless i is in mlp_only_layers or i + 1 is
    not a multiple of decoder_sparse_step (those are dense MLPs); no layer of a dense
    model. () (unknown) in records stored before it existed.
    """

    architecture: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    num_experts: int = 0
    moe_layers: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        # A record read back from JSON holds a list; a tuple keeps the shape hashable.
        object.__setattr__(self, "moe_layers", tuple(self.moe_layers))

    @classmethod
    def from_record(cls, d: dict) -> BaseShape:
        """A shape stored as JSON (the registry's records). Fields this version does not
        know are dropped, so a record written by a newer version (with a field added)
        still reads while a cluster is upgraded; fields it lacks take their defaults."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @property
    def lora_groups(self) -> tuple[str, ...]:
        """The groups adapters may target: all of GROUPS, or only attention's (qkv, o)
        for a mixture-of-experts model (its MLP side takes no LoRA: MOE_PARTS)."""
        return ATTENTION_GROUPS if self.num_experts else tuple(GROUPS)

    @property
    def lora_modules(self) -> tuple[str, ...]:
        """The PEFT module names of lora_groups, e.g. ("q_proj", "k_proj", "v_proj", "o_proj")."""
        return tuple(m for g in self.lora_groups for m in GROUPS[g])

    @classmethod
    def from_hf_config(cls, cfg: dict) -> BaseShape:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadFailed(
                f"architectures={archs!r}; allowed: one of {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        experts = _num_experts(cfg, arch)
        layers = int(cfg["num_hidden_layers"])
        return cls(
            architecture=arch,
            num_layers=layers,
            hidden=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or _DEFAULT_HEAD_DIM.get(arch, hidden // heads)),
            intermediate=int(cfg["intermediate_size"]),
            num_experts=experts,
            moe_layers=_moe_layers(cfg, arch, layers),
        )

    @property
    def moe_parts(self) -> str:
        """What of this mixture-of-experts model takes no LoRA, e.g. "router and experts"."""
        return MOE_PARTS[self.architecture]

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a PEFT module name."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes = {
            "q_proj": (self.hidden, q),
            "k_proj": (self.hidden, kv),
            "v_proj": (self.hidden, kv),
            "o_proj": (q, self.hidden),
            "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }
        return shapes[module]

    def group_sizes(self, group: str) -> tuple[int, tuple[int, ...]]:
        """(in_features, out_features of each slice) of a fused group."""
        mods = GROUPS[group]
        return self.module_shape(mods[0])[0], tuple(self.module_shape(m)[1] for m in mods)

    def shard_sizes(self, group: str, tp_size: int) -> tuple[int, tuple[int, ...]]:
        """group_sizes of one tensor-parallel rank's shard: row-parallel groups split
        in_features, column-parallel groups split every slice's out_features."""
        h, outs = self.group_sizes(group)
        sizes = (h,) + outs
        if any(n % tp_size for n in sizes):
            raise ValueError(
                f"{group}: sizes {sizes} do not divide by tensor_parallel_size={tp_size}; "
                "allowed: a tensor_parallel_size dividing the heads and intermediate_size"
            )
        if group in ROW_PARALLEL_GROUPS:
            return h // tp_size, outs
        return h, tuple(n // tp_size for n in outs)


def _num_experts(cfg: dict, arch: str) -> int:
    """A mixture-of-experts config's expert count (>= 1, refused otherwise); 0 for a dense
    architecture."""
    if arch not in MOE_ARCHITECTURES:
        return 0
    field = EXPERTS_FIELD[arch]
    value = cfg.get(field, cfg.get("num_local_experts"))
    if value is None:
        raise KeyError(field)
    if int(value) < 1:
        raise ModelLoadFailed(f"{field}={value}; allowed: >= 1 for {arch}")
    return int(value)


def _moe_layers(cfg: dict, arch: str, num_layers: int) -> tuple[bool, ...]:
    """Which layers are sparse MoE blocks (`BaseShape.moe_layers`); ModelLoadFailed for a
    Qwen MoE's decoder_sparse_step or mlp_only_layers transformers would not build."""
    if arch not in QWEN_MOE_ARCHITECTURES:
        return (arch == "MixtralForCausalLM",) * num_layers
    step = cfg.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ModelLoadFailed(f"decoder_sparse_step={step!r}; allowed: an integer >= 1")
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
        isinstance(i, int) and 0 <= i < num_layers for i in dense
    ):
        raise ModelLoadFailed(
            f"mlp_only_layers={dense!r}; allowed: a list of layer indices 0..{num_layers - 1}"
        )
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
