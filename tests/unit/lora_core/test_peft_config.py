import json
import math

import pytest
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils.other import get_pattern_key

from lora_core.base_shape import BaseShape
from lora_core.errors import AdapterIncompatible
from lora_core.module_names import supported_keys, unsupported_keys
from lora_core.peft_config import LoraSpec

KEYS = supported_keys(3) + unsupported_keys(3)

CASES = [
    dict(target_modules=["q_proj", "v_proj"]),
    dict(target_modules=["self_attn.q_proj", "down_proj"]),
    dict(target_modules=r"model\.layers\.[01]\.self_attn\.(q|k)_proj"),
    dict(target_modules=r".*mlp\.(gate|up)_proj"),
    dict(target_modules=["q_proj", "up_proj"], layers_to_transform=[1]),
    dict(target_modules=["q_proj"], layers_to_transform=0, layers_pattern="layers"),
    dict(target_modules=["q_proj", "k_proj"], exclude_modules=["model.layers.1.self_attn.k_proj"]),
    dict(
        target_modules=["q_proj", "k_proj", "o_proj"],
        rank_pattern={"k_proj": 2, r"layers\.1\.self_attn\.q_proj": 3},
    ),
    dict(target_modules=["q_proj", "v_proj"], alpha_pattern={"v_proj": 3.0}, use_rslora=True),
]


def _spec(kwargs: dict) -> LoraSpec:
    cfg = LoraConfig(r=4, lora_alpha=8, **kwargs).to_dict()
    # what save_pretrained writes: sets become lists, enums strings
    return LoraSpec.from_dict(json.loads(json.dumps(cfg, default=_jsonable)))


def _jsonable(value: object) -> object:
    return sorted(value) if isinstance(value, set) else str(value)


@pytest.mark.parametrize("kwargs", CASES)
def test_targets_match_peft(kwargs: dict) -> None:
    spec = _spec(kwargs)
    config = LoraConfig(r=4, lora_alpha=8, **kwargs)
    for key in KEYS:
        assert spec.targets(key) == bool(check_target_module_exists(config, key)), key
        assert spec.targets("base_model.model." + key) == spec.targets(key)


@pytest.mark.parametrize("kwargs", CASES)
def test_rank_and_alpha_match_peft(kwargs: dict) -> None:
    spec = _spec(kwargs)
    config = LoraConfig(r=4, lora_alpha=8, **kwargs)
    for key in supported_keys(3):
        r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), key), config.r)
        a = config.alpha_pattern.get(
            get_pattern_key(config.alpha_pattern.keys(), key), config.lora_alpha
        )
        assert spec.rank_for(key) == r
        assert spec.alpha_for(key) == a
        expected = a / math.sqrt(r) if config.use_rslora else a / r
        assert spec.scaling_for(key) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("kwargs", CASES)
def test_spec_agrees_with_built_peft_model(kwargs: dict, build_peft) -> None:
    model = build_peft(**kwargs)
    spec = _spec(kwargs)
    inner = model.base_model.model
    layers = {name: m for name, m in inner.named_modules() if isinstance(m, LoraLayer)}
    assert sorted(layers) == sorted(k for k in supported_keys(2) if spec.targets(k))
    for name, layer in layers.items():
        assert layer.r["default"] == spec.rank_for(name)
        assert layer.scaling["default"] == pytest.approx(spec.scaling_for(name), rel=1e-12)


def _base_cfg(**changes: object) -> dict:
    cfg = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj"],
        "bias": "none",
    }
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(use_dora=True), "use_dora"),
        (dict(bias="lora_only"), "bias"),
        (dict(bias="all"), "bias"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(peft_type="IA3"), "peft_type"),
        (dict(lora_bias=True), "lora_bias"),
        (dict(r=0), "r"),
        (dict(r="8"), "r"),
        (dict(lora_alpha=-1), "lora_alpha"),
        (dict(target_modules=None), "target_modules"),
        (dict(target_modules=[]), "target_modules"),
        (dict(target_modules="q_proj("), "target_modules"),
        (dict(rank_pattern={"q_proj": 0}), "rank_pattern['q_proj']"),
        (dict(layers_to_transform=["a"]), "layers_to_transform"),
        (dict(use_rslora="yes"), "use_rslora"),
        (dict(layer_replication=[[0, 1]]), "layer_replication"),
        (dict(lora_dropout="x"), "lora_dropout"),
        (dict(trainable_token_indices=[1, 2]), "trainable_token_indices"),
    ],
)
def test_refusals_name_the_field(changes: dict, field: str) -> None:
    with pytest.raises(AdapterIncompatible) as e:
        LoraSpec.from_dict(_base_cfg(**changes))
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}: ")
    assert "allowed: " in str(e.value)


ATTENTION = "q_proj, k_proj, v_proj, o_proj"
DENSE = f"{ATTENTION}, gate_proj, up_proj, down_proj"


@pytest.mark.parametrize(
    ("num_experts", "on"),
    [
        (None, f"{DENSE} (a dense base) or {ATTENTION} (a mixture-of-experts one)"),
        (0, DENSE),
        (4, f"{ATTENTION} (attention)"),
    ],
    ids=["unknown-base", "dense-base", "moe-base"],
)
def test_target_parameters_refusal_allows_what_the_base_takes(num_experts, on) -> None:
    """What a target_parameters adapter may use instead: the projections the base takes
    LoRA on where its shape is known, else those of either kind of base."""
    base = None
    if num_experts is not None:
        arch = "MixtralForCausalLM" if num_experts else "LlamaForCausalLM"
        base = BaseShape(arch, num_layers=2, hidden=64, num_heads=4, num_kv_heads=2,
                         head_dim=16, intermediate=128, num_experts=num_experts)  # fmt: skip
    with pytest.raises(AdapterIncompatible) as e:
        LoraSpec.from_dict(_base_cfg(target_parameters=["mlp.experts.down_proj"]), base)
    assert (e.value.field, e.value.problem, e.value.allowed) == (
        "target_parameters",
        "['mlp.experts.down_proj'] targets parameters (as peft does for mixture-of-experts "
        "expert weights), which this engine cannot adapt",
        f"null or []; LoRA through target_modules on {on}",
    )


def test_defaults_and_base_model() -> None:
    spec = LoraSpec.from_dict(_base_cfg(base_model_name_or_path="meta/llama", lora_dropout=0.1))
    assert (spec.r, spec.lora_alpha, spec.base_model, spec.lora_dropout) == (
        4,
        8.0,
        "meta/llama",
        0.1,
    )
    assert spec.target_modules == ("q_proj",)
    assert spec.scaling_for("model.layers.0.self_attn.q_proj") == 2.0


def test_all_linear_means_every_projection() -> None:
    spec = LoraSpec.from_dict(_base_cfg(target_modules="all-linear"))
    assert [k for k in KEYS if spec.targets(k)] == supported_keys(3)
