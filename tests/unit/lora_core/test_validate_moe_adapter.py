"""Adapters of a mixture-of-experts base (Mixtral): LoRA on q/k/v/o validates; any
adapter reaching the router or the experts is refused at validation, naming the module
and what this model allows: PEFT's target_parameters (what peft 0.21 saves for "gate",
fused experts and "all-linear" on transformers 5's Mixtral), target_modules naming the
router, experts or their per-expert w1/w2/w3 (older transformers' naming) or a dense
MLP's projections, and expert tensors the config does not declare."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from lora_core.base_shape import BaseShape
from lora_core.errors import AdapterIncompatible
from lora_core.validate import validate_adapter_dir
from tests.tiny import make_peft_adapter

ATTENTION = "q_proj, k_proj, v_proj, o_proj"


@pytest.fixture(scope="module")
def base(mixtral_dir) -> BaseShape:
    return BaseShape.from_hf_config(json.loads((mixtral_dir / "config.json").read_text()))


def _refused(path: Path, base: BaseShape) -> AdapterIncompatible:
    with pytest.raises(AdapterIncompatible) as e:
        validate_adapter_dir(path, max_rank=16, base=base)
    return e.value


def test_attention_adapters_validate(base, mixtral_adapters):
    assert base.num_experts == 4 and base.lora_groups == ("qkv", "o")
    for path in mixtral_adapters.values():
        m = validate_adapter_dir(path, max_rank=16, base=base)
        assert set(m.target_modules) <= {"q_proj", "k_proj", "v_proj", "o_proj"}


@pytest.mark.parametrize(
    ("lora", "named"),
    [
        (dict(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
         "mlp.experts.gate_up_proj"),
        (dict(target_modules=["q_proj", "gate"]), "gate.weight"),  # peft makes it a parameter
        (dict(target_modules="all-linear"), "gate_up_proj"),
    ],
    ids=["experts", "router", "all-linear"],
)  # fmt: skip
def test_peft_expert_adapters_refused(base, mixtral_dir, tmp_path, lora, named):
    lora.setdefault("target_modules", ["q_proj"])
    path = make_peft_adapter(mixtral_dir, tmp_path / "a", r=4, lora_alpha=8, **lora)
    err = _refused(path, base)
    assert err.field == "target_parameters"
    assert named in err.problem and "mixture-of-experts expert weights" in err.problem
    assert err.allowed == f"null or []; LoRA through target_modules on {ATTENTION} (attention)"


@pytest.mark.parametrize(
    ("targets", "key"),
    [
        (["q_proj", "w1", "w2", "w3"], "model.layers.0.block_sparse_moe.experts.0.w1"),
        (["q_proj", "experts"], "model.layers.0.mlp.experts"),
        (["q_proj", "gate"], "model.layers.0.mlp.gate"),
        (["q_proj", "block_sparse_moe.gate"], "model.layers.0.block_sparse_moe.gate"),
        (["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"], "model.layers.0.mlp.gate_proj"),
        (r".*\.(q_proj|experts\.\d+\.w2)", "model.layers.0.block_sparse_moe.experts.0.w2"),
    ],
)  # fmt: skip
def test_expert_target_modules_refused(base, mixtral_adapters, tmp_path, targets, key):
    path = tmp_path / "a"
    shutil.copytree(mixtral_adapters["qv8"], path)
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["target_modules"] = targets
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    err = _refused(path, base)
    assert err.field == "target_modules"
    assert err.problem == (
        f"matches {key!r}: MixtralForCausalLM is a mixture-of-experts model whose router and "
        "experts take no LoRA"
    )
    assert err.allowed == f"{ATTENTION} (attention)"


def test_a_module_the_model_lacks_names_its_allowed_modules(base, mixtral_adapters, tmp_path):
    path = tmp_path / "a"
    shutil.copytree(mixtral_adapters["qv8"], path)
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "fc1"]
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    err = _refused(path, base)
    assert (err.field, err.problem, err.allowed) == (
        "target_modules",
        "'fc1' matches no module of the base model",
        ATTENTION,
    )


def test_undeclared_expert_tensors_refused(base, mixtral_dir, tmp_path):
    """Expert LoRA tensors under a config that no longer declares them are not dropped."""
    path = make_peft_adapter(
        mixtral_dir, tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj"],
        target_parameters=["mlp.experts.down_proj"],
    )  # fmt: skip
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["target_parameters"] = None
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(path / "adapter_model.safetensors"))
    assert any(".mlp.experts." in name for name in tensors)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    err = _refused(path, base)
    assert ".mlp.experts." in err.field
    assert err.problem == "not a lora_A/lora_B weight of a supported module"
