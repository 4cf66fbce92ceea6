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
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_core.base_shape import BaseShape
from lora_core.errors import AdapterIncompatible
from lora_core.identity import AdapterRef
from lora_core.manager import AdapterManager
from lora_core.slot_buffers import SlotBuffers
from lora_core.validate import content_hash, validate_adapter_dir
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
    """peft adapts Qwen2-MoE's shared expert, its gate and the dense MLPs as linear layers.
    peft >= 0.22 also turns names that match the fused experts (gate_up_proj, down_proj)
    into target_parameters, which are refused first (the Qwen3 test above)."""
    path = make_peft_adapter(
        qwen2_moe_dir, tmp_path / "a", r=4, lora_alpha=8, target_modules=targets
    )
    err = _refused(path, _base(qwen2_moe_dir))
    if json.loads((path / "adapter_config.json").read_text()).get("target_parameters"):
        assert err.field == "target_parameters"
        assert "mixture-of-experts expert weights" in err.problem
        return
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
        ("qwen3_moe", ["q_proj", "mlp.gate_proj"], "model.layers.1.mlp.gate_proj"),
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


def _with_mlp_keys(src: Path, dst: Path, module: str, keys: list[str]) -> Path:
    """A copy of the q/v adapter src whose target_modules add `module`, with rank-8 LoRA
    tensors at `keys` (shapes do not matter: the refusal comes first). -> dst."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "v_proj", module]
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(dst / "adapter_model.safetensors"))
    for key in keys:
        tensors[f"base_model.model.{key}.lora_A.weight"] = torch.zeros(8, 64)
        tensors[f"base_model.model.{key}.lora_B.weight"] = torch.zeros(64, 8)
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


# The tiny Qwen3-MoE's layer 1 is dense (mlp_only_layers): only it has mlp.<module>; the
# sparse layers 0 and 2 have experts (per expert in older transformers' naming).
@pytest.mark.parametrize(
    ("module", "keys", "named"),
    [
        ("down_proj", ["model.layers.1.mlp.down_proj"], "model.layers.1.mlp.down_proj"),
        ("gate_proj", ["model.layers.1.mlp.gate_proj"]
         + [f"model.layers.{i}.mlp.experts.{e}.gate_proj" for i in (0, 2) for e in range(4)],
         "model.layers.0.mlp.experts.0.gate_proj"),
    ],
    ids=["dense-layer", "dense-layer-and-per-expert"],
)  # fmt: skip
def test_refusal_names_the_adapters_own_key(
    qwen3_moe_dir, qwen3_moe_adapters, tmp_path, module, keys, named
):
    """The registry's validation and a replica's load both refuse target_modules reaching a
    Qwen MoE's MLP side naming the first such module the adapter holds tensors for (layer
    major), not layer 0's dense key, which neither the model nor the adapter has."""
    path = _with_mlp_keys(qwen3_moe_adapters["qv8"], tmp_path / "a", module, keys)
    base = _base(qwen3_moe_dir)
    problem = (
        f"matches {named!r}: Qwen3MoeForCausalLM is a mixture-of-experts "
        f"model whose {PARTS['Qwen3MoeForCausalLM']} take no LoRA"
    )
    registry = _refused(path, base)
    buffers = SlotBuffers(base, max_loras=1, max_rank=16, dtype=torch.float32, device="cpu")
    manager = AdapterManager(base, buffers, max_cpu_loras=1, max_rank=16, dtype=torch.float32)
    with pytest.raises(AdapterIncompatible) as replica:
        manager.register(AdapterRef("a", 1, content_hash(path), str(path), rank=8))
    manager.close()
    for err in (registry, replica.value):
        assert (err.field, err.problem, err.allowed) == (
            "target_modules",
            problem,
            f"{ATTENTION} (attention)",
        )


# Which layers are sparse (moe_layers), and what the config targets without a tensor of the
# MLP side: the refusal names the first targeted module (layer-major) the model has, never
# a sparse layer's dense mlp.<module> or a dense layer's router, experts or shared expert.
@pytest.mark.parametrize(
    ("arch", "fields", "module", "named"),
    [
        ("qwen3_moe", {}, "down_proj", "model.layers.0.mlp.experts.0.down_proj"),
        ("qwen3_moe", {"mlp_only_layers": [0]}, "down_proj", "model.layers.0.mlp.down_proj"),
        ("qwen3_moe", {"mlp_only_layers": [], "decoder_sparse_step": 2}, "gate",
         "model.layers.1.mlp.gate"),
        ("qwen2_moe", {"mlp_only_layers": [0]}, "down_proj", "model.layers.0.mlp.down_proj"),
        ("qwen2_moe", {"mlp_only_layers": [0, 1]}, "shared_expert_gate",
         "model.layers.2.mlp.shared_expert_gate"),
    ],
    ids=["sparse-layer-0", "dense-layer-0", "sparse-step-2", "qwen2-dense-layer-0",
         "qwen2-shared-gate"],
)  # fmt: skip
def test_refusal_without_mlp_tensors_names_a_module_of_the_model(
    request, tmp_path, arch, fields, module, named
):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    cfg = {**json.loads((model_dir / "config.json").read_text()), **fields}
    base = BaseShape.from_hf_config(cfg)
    src = request.getfixturevalue(f"{arch}_adapters")["qv8"]
    err = _refused(_with_mlp_keys(src, tmp_path / "a", module, []), base)
    assert (err.field, err.allowed) == ("target_modules", f"{ATTENTION} (attention)")
    assert err.problem == (
        f"matches {named!r}: {base.architecture} is a mixture-of-experts model whose "
        f"{PARTS[base.architecture]} take no LoRA"
    )


def test_refusal_against_a_base_recorded_without_its_sparse_layers(
    qwen3_moe_dir, qwen3_moe_adapters, tmp_path
):
    """A base shape stored before moe_layers existed (()) names the first targeted key."""
    base = replace(_base(qwen3_moe_dir), moe_layers=())
    err = _refused(_with_mlp_keys(qwen3_moe_adapters["qv8"], tmp_path / "a", "down_proj", []), base)
    assert err.problem.startswith("matches 'model.layers.0.mlp.down_proj': ")
