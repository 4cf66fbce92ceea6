"""Adapters of a Qwen mixture-of-experts base: LoRA on q/k/v/o validates; any adapter
reaching the router, the experts, Qwen2-MoE's shared expert (or its gate) or the dense
MLPs of mlp_only_layers is refused at validation, naming the module and what the model
allows: what peft 0.21 saves for such targets on transformers 5's Qwen MoE models
(target_parameters for Qwen3-MoE's router and fused experts; target_modules for
Qwen2-MoE's shared expert and dense MLPs), and target_modules naming the per-expert
projections of older transformers' naming."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lora_core.base_shape import BaseShape
from lora_core.errors import AdapterIncompatible
from lora_core.validate import validate_adapter_dir
from tests.tiny import make_peft_adapter

ATTENTION = "q_proj, k_proj, v_proj, o_proj"
PARTS = {
    "Qwen3MoeForCausalLM": "router, experts and dense MLP layers",
    "Qwen2MoeForCausalLM": "router, experts, shared expert and dense MLP layers",
}


def _base(model_dir: Path) -> BaseShape:
    return BaseShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))


def _refused(path: Path, base: BaseShape) -> AdapterIncompatible:
    with pytest.raises(AdapterIncompatible) as e:
        validate_adapter_dir(path, max_rank=16, base=base)
    return e.value


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_attention_adapters_validate(request, arch):
    base = _base(request.getfixturevalue(f"{arch}_dir"))
    assert base.num_experts == 4 and base.lora_groups == ("qkv", "o")
    for path in request.getfixturevalue(f"{arch}_adapters").values():
        m = validate_adapter_dir(path, max_rank=16, base=base)
        assert set(m.target_modules) <= {"q_proj", "k_proj", "v_proj", "o_proj"}


@pytest.mark.parametrize(
    ("targets", "named"),
    [("all-linear", "gate_up_proj"), (["q_proj", "gate"], "gate.weight")],
    ids=["all-linear", "router"],
)
def test_peft_qwen3_expert_adapters_refused(qwen3_moe_dir, tmp_path, targets, named):
    """peft turns Qwen3-MoE's router and fused experts into target_parameters."""
    path = make_peft_adapter(
        qwen3_moe_dir, tmp_path / "a", r=4, lora_alpha=8, target_modules=targets
    )
    err = _refused(path, _base(qwen3_moe_dir))
    assert err.field == "target_parameters"
    assert named in err.problem and "mixture-of-experts expert weights" in err.problem
    assert err.allowed == f"null or []; LoRA through target_modules on {ATTENTION} (attention)"


@pytest.mark.parametrize(
    ("targets", "key"),
    [
        ("all-linear", "model.layers.0.mlp.shared_expert_gate"),
        (["q_proj", "gate_proj", "up_proj"], "model.layers.0.mlp.shared_expert.gate_proj"),
        (["q_proj", "shared_expert_gate"], "model.layers.0.mlp.shared_expert_gate"),
        (["q_proj", "down_proj"], "model.layers.0.mlp.shared_expert.down_proj"),
    ],
)
def test_peft_qwen2_shared_expert_and_dense_adapters_refused(qwen2_moe_dir, tmp_path, targets, key):
    """peft adapts Qwen2-MoE's shared expert, its gate and the dense MLPs as linear layers."""
    path = make_peft_adapter(
        qwen2_moe_dir, tmp_path / "a", r=4, lora_alpha=8, target_modules=targets
    )
    err = _refused(path, _base(qwen2_moe_dir))
    assert (err.field, err.allowed) == ("target_modules", f"{ATTENTION} (attention)")
    assert err.problem == (
        f"matches {key!r}: Qwen2MoeForCausalLM is a mixture-of-experts model whose "
        f"{PARTS['Qwen2MoeForCausalLM']} take no LoRA"
    )


@pytest.mark.parametrize(
    ("arch", "targets", "key"),
    [
        ("qwen3_moe", ["q_proj", "experts"], "model.layers.0.mlp.experts"),
        ("qwen3_moe", r".*\.(q_proj|experts\.\d+\.down_proj)", "model.layers.0.mlp.experts.0.down_proj"),
        ("qwen3_moe", ["q_proj", "mlp.gate_proj"], "model.layers.0.mlp.gate_proj"),
        ("qwen3_moe", r".*\.(q_proj|layers\.1\.mlp\.up_proj)", "model.layers.1.mlp.up_proj"),
        ("qwen2_moe", ["q_proj", "shared_expert"], "model.layers.0.mlp.shared_expert"),
        ("qwen2_moe", ["q_proj", "experts.3.up_proj"], "model.layers.0.mlp.experts.3.up_proj"),
    ],
)  # fmt: skip
def test_mlp_side_target_modules_refused(request, tmp_path, arch, targets, key):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    path = tmp_path / "a"
    shutil.copytree(request.getfixturevalue(f"{arch}_adapters")["qv8"], path)
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["target_modules"] = targets
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    base = _base(model_dir)
    err = _refused(path, base)
    assert (err.field, err.allowed) == ("target_modules", f"{ATTENTION} (attention)")
    assert err.problem == (
        f"matches {key!r}: {base.architecture} is a mixture-of-experts model whose "
        f"{PARTS[base.architecture]} take no LoRA"
    )


def test_qwen3_has_no_shared_expert(qwen3_moe_dir, qwen3_moe_adapters, tmp_path):
    path = tmp_path / "a"
    shutil.copytree(qwen3_moe_adapters["qv8"], path)
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "shared_expert_gate"]
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    err = _refused(path, _base(qwen3_moe_dir))
    assert (err.field, err.problem, err.allowed) == (
        "target_modules",
        "'shared_expert_gate' matches no module of the base model",
        ATTENTION,
    )
