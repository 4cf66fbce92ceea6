import json
from pathlib import Path

import pytest
import torch

from lora_core.base_shape import GROUPS, MODULE_GROUP
from lora_core.errors import AdapterIncompatible, AdapterLoadFailed
from lora_core.validate import validate_adapter_dir
from lora_core.weights import load_adapter_weights

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VARIANTS = [
    dict(target_modules=["q_proj", "v_proj"]),
    dict(
        target_modules=ALL, rank_pattern={"k_proj": 2, "down_proj": 6}, alpha_pattern={"v_proj": 3}
    ),
    dict(target_modules=ALL, r=8, lora_alpha=4, use_rslora=True),
    dict(
        target_modules=["o_proj", "up_proj"],
        rank_pattern={r"layers\.1\.mlp\.up_proj": 1},
        use_rslora=True,
    ),
]


def _module(peft_model, layer: int, name: str):
    decoder = peft_model.base_model.model.model.layers[layer]
    return getattr(decoder.self_attn if name in ALL[:4] else decoder.mlp, name)


def _peft_delta(peft_model, layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
    """The PEFT LoRA layer's output minus its base layer's output."""
    m = _module(peft_model, layer, name)
    return m(x) - m.base_layer(x)


@pytest.mark.parametrize("fan_in_fan_out", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_delta_equals_peft(
    tmp_path: Path, build_peft, base, variant, fan_in_fan_out
) -> None:
    model = build_peft(**variant).double()
    model.save_pretrained(str(tmp_path / "a"))
    if fan_in_fan_out:
        # PEFT forces it false for nn.Linear; a config saying true must not transpose A/B.
        cfg = json.loads((tmp_path / "a/adapter_config.json").read_text())
        (tmp_path / "a/adapter_config.json").write_text(json.dumps({**cfg, "fan_in_fan_out": True}))
    manifest = validate_adapter_dir(tmp_path / "a", max_rank=8, base=base)
    weights = load_adapter_weights(manifest, base, torch.float64)
    gen = torch.Generator().manual_seed(0)
    for layer in range(base.num_layers):
        for name in ALL:
            group, s = MODULE_GROUP[name]
            sw = weights.slices(layer, group)[s]
            if (layer, name) not in manifest.modules:
                assert sw is None
                continue
            x = torch.randn(5, base.module_shape(name)[0], generator=gen, dtype=torch.float64)
            ours = x @ sw.a.T @ sw.b.T
            torch.testing.assert_close(
                ours, _peft_delta(model, layer, name, x), rtol=1e-12, atol=1e-12
            )
            assert sw.rank == manifest.modules[(layer, name)].rank


def test_qwen2_packed_delta_equals_peft(tmp_path: Path, build_peft) -> None:
    from lora_core.base_shape import BaseShape

    model = build_peft(arch="qwen2", target_modules=ALL, r=4, rank_pattern={"v_proj": 2}).double()
    model.save_pretrained(str(tmp_path / "q"))
    cfg = model.base_model.model.config.to_dict()
    base = BaseShape.from_hf_config({**cfg, "architectures": ["Qwen2ForCausalLM"]})
    manifest = validate_adapter_dir(tmp_path / "q", max_rank=4, base=base)
    weights = load_adapter_weights(manifest, base, torch.float64)
    x = torch.randn(3, 64, dtype=torch.float64)
    for name in ("q_proj", "v_proj"):  # q/k/v carry a base bias in Qwen2: deltas exclude it
        sw = weights.slices(1, "qkv")[MODULE_GROUP[name][1]]
        torch.testing.assert_close(
            x @ sw.a.T @ sw.b.T, _peft_delta(model, 1, name, x), rtol=1e-12, atol=1e-12
        )


def test_dtype_layout_and_nbytes(make_adapter, base) -> None:
    path = make_adapter(target_modules=["q_proj", "gate_proj"], rank_pattern={"gate_proj": 2})
    weights = load_adapter_weights(
        validate_adapter_dir(path, max_rank=8, base=base), base, torch.bfloat16
    )
    assert weights.rank == 4
    assert len(weights.layers) == 2 and set(weights.layers[0]) == set(GROUPS)
    q, k, v = weights.slices(0, "qkv")
    assert k is None and v is None and weights.slices(1, "o") == (None,)
    assert (q.a.shape, q.b.shape, q.a.dtype) == ((4, 64), (64, 4), torch.bfloat16)
    gate, up = weights.slices(1, "gate_up")
    assert up is None and (gate.a.shape, gate.b.shape) == ((2, 64), (128, 2))
    per_layer = (4 * 64 + 64 * 4) + (2 * 64 + 128 * 2)
    assert weights.nbytes == 2 * per_layer * 2


def test_changed_files_refused(make_adapter, base) -> None:
    path = make_adapter()
    manifest = validate_adapter_dir(path, max_rank=8, base=base)
    cfg = path / "adapter_config.json"
    cfg.write_text(cfg.read_text() + " ")
    with pytest.raises(AdapterLoadFailed, match="files changed since validation"):
        load_adapter_weights(manifest, base, torch.float32)


def test_manifest_validated_without_base_must_fit(make_adapter, base) -> None:
    from dataclasses import replace

    manifest = validate_adapter_dir(make_adapter(), max_rank=8)
    with pytest.raises(AdapterIncompatible) as e:
        load_adapter_weights(manifest, replace(base, num_layers=1), torch.float32)
    assert e.value.field == "model.layers.1.self_attn.q_proj.lora_A.weight"
    with pytest.raises(AdapterIncompatible) as e:
        load_adapter_weights(manifest, replace(base, hidden=32), torch.float32)
    assert "lora_A [r, 32]" in e.value.allowed


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_weights_are_widened_exactly(make_adapter, base, fp8) -> None:
    """FP8 safetensors (F8_E4M3 / F8_E5M2) are accepted, as vLLM's .to(dtype) accepts
    them: the packed A is the FP8 value widened, B the widened value times the scaling."""
    from safetensors.torch import load_file, save_file

    path = make_adapter(target_modules=["q_proj"], lora_alpha=16)
    file = str(path / "adapter_model.safetensors")
    tensors = {k: v.to(fp8) for k, v in load_file(file).items()}
    save_file(tensors, file)
    manifest = validate_adapter_dir(path, max_rank=8, base=base)
    weights = load_adapter_weights(manifest, base, torch.float32)
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    (q, _, _) = weights.slices(0, "qkv")
    scaling = manifest.modules[(0, "q_proj")].scaling
    assert torch.equal(q.a, tensors[f"{name}.lora_A.weight"].to(torch.float32))
    want_b = (tensors[f"{name}.lora_B.weight"].to(torch.float64) * scaling).to(torch.float32)
    assert torch.equal(q.b, want_b) and q.b.abs().sum() > 0
