import hashlib
import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_core.adapter_files import read_adapter_files
from lora_core.errors import AdapterIncompatible, AdapterLoadFailed
from lora_core.validate import (
    ModuleInfo,
    content_hash,
    validate_adapter_dir,
    validate_adapter_files,
)


def _validate(path, **kw):
    """validate_adapter_dir, checked against the replica's path (the files read once, then
    validate_adapter_files): both give the same manifest or the same error."""
    outcomes = []
    for run in (
        lambda: validate_adapter_dir(path, **kw),
        lambda: validate_adapter_files(read_adapter_files(path), **kw),
    ):
        try:
            outcomes.append(run())
        except (AdapterIncompatible, AdapterLoadFailed) as e:
            outcomes.append(e)
    by_dir, by_files = outcomes
    if isinstance(by_dir, Exception):
        assert (type(by_files), str(by_files)) == (type(by_dir), str(by_dir))
        raise by_dir
    assert by_files == by_dir
    return by_dir


def _edit(path: Path, **changes: object) -> None:
    cfg_path = path / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(changes)
    cfg_path.write_text(json.dumps(cfg))


def _edit_tensors(path: Path, fn) -> None:
    file = path / "adapter_model.safetensors"
    tensors = load_file(str(file))
    fn(tensors)
    save_file(tensors, str(file))


WIDE_FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


def test_manifest_of_a_real_adapter(make_adapter, base) -> None:
    path = make_adapter(
        target_modules=["q_proj", "v_proj", "down_proj"], rank_pattern={"v_proj": 2}
    )
    _edit(path, base_model_name_or_path="tiny/llama")
    m = _validate(path, max_rank=8, base=base)
    assert m.path == str(path.resolve())
    assert m.rank == 4
    assert m.target_modules == ("down_proj", "q_proj", "v_proj")
    assert m.base_model == "tiny/llama"
    assert m.modules == {
        (i, mod): ModuleInfo(r, fin, fout, 8 / r, "F32")
        for i in range(2)
        for mod, r, fin, fout in (
            ("q_proj", 4, 64, 64),
            ("v_proj", 2, 64, 32),
            ("down_proj", 4, 128, 64),
        )
    }
    raw = (path / "adapter_config.json").read_bytes() + (
        path / "adapter_model.safetensors"
    ).read_bytes()
    assert m.content_hash == hashlib.sha256(raw).hexdigest() == content_hash(path)


def test_qwen2_adapter_and_no_base(make_adapter) -> None:
    path = make_adapter(arch="qwen2", target_modules=r".*\.(k_proj|gate_proj)")
    m = _validate(str(path), max_rank=4)
    assert m.target_modules == ("gate_proj", "k_proj")
    assert sorted(m.modules) == [(0, "gate_proj"), (0, "k_proj"), (1, "gate_proj"), (1, "k_proj")]


def test_layers_to_transform(make_adapter, base) -> None:
    path = make_adapter(target_modules=["o_proj"], layers_to_transform=[1])
    m = _validate(path, max_rank=8, base=base)
    assert sorted(m.modules) == [(1, "o_proj")]


@pytest.mark.parametrize("with_base", [True, False])
def test_all_linear_with_exclude_modules_as_peft_saves_it(make_adapter, base, with_base) -> None:
    """peft saves "all-linear" + exclude_modules with every linear (the excluded ones
    too) in target_modules and tensors only for the others: that is a valid adapter."""
    path = make_adapter(target_modules="all-linear", exclude_modules=["o_proj"])
    saved = json.loads((path / "adapter_config.json").read_text())["target_modules"]
    assert any(t.endswith("o_proj") for t in saved)
    m = _validate(path, max_rank=8, base=base if with_base else None)
    assert {mod for _, mod in m.modules} == {
        "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip
    assert len(m.modules) == 12


def test_symlink_is_resolved(make_adapter, tmp_path: Path) -> None:
    path = make_adapter()
    os.symlink(path, tmp_path / "link")
    assert _validate(tmp_path / "link", max_rank=8).path == str(path.resolve())


def _incompatible(path: Path, field: str, base=None, max_rank: int = 8) -> AdapterIncompatible:
    with pytest.raises(AdapterIncompatible) as e:
        _validate(path, max_rank=max_rank, base=base)
    assert e.value.field == field, str(e.value)
    assert str(e.value).startswith(f"{field}: ") and "allowed: " in str(e.value)
    return e.value


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(use_dora=True), "use_dora"),
        (dict(bias="all"), "bias"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(peft_type="LOHA"), "peft_type"),
        (dict(target_modules=["q_proj", "v_proj", "lm_head"]), "target_modules"),
        (dict(target_modules=["q_proj", "v_proj", "embed_tokens"]), "target_modules"),
        (dict(target_modules=["q_proj", "v_proj", "mlp.fc1"]), "target_modules"),
        (dict(target_modules=r".*"), "target_modules"),
        # Qwen3's per-head q/k norms take no LoRA (a regex reaching them is refused)
        (dict(target_modules=r".*\.(q_proj|v_proj|q_norm)"), "target_modules"),
        (dict(target_modules=r".*\.(q_proj|v_proj|k_norm)"), "target_modules"),
        (dict(target_modules=r"nothing\.here"), "target_modules"),
    ],
)
def test_config_tampering_refused(make_adapter, base, changes: dict, field: str) -> None:
    path = make_adapter()
    _edit(path, **changes)
    _incompatible(path, field, base)
    _incompatible(path, field, None)


def test_dora_adapter_built_with_peft_refused(make_adapter) -> None:
    path = make_adapter(use_dora=True)
    assert _incompatible(path, "use_dora").problem == "DoRA adapters are not supported"


def test_lm_head_adapter_built_with_peft_refused(make_adapter) -> None:
    err = _incompatible(make_adapter(target_modules=["q_proj", "lm_head"]), "target_modules")
    assert "lm_head" in err.problem


def test_modules_to_save_built_with_peft_refused(make_adapter) -> None:
    _incompatible(make_adapter(modules_to_save=["lm_head"]), "modules_to_save")


def test_rank_too_high(make_adapter, base) -> None:
    _incompatible(make_adapter(r=8), "r", base, max_rank=4)
    path = make_adapter("b", r=4, rank_pattern={"v_proj": 16})
    err = _incompatible(path, "rank_pattern['v_proj']", base, max_rank=8)
    assert "16" in err.problem and err.allowed == "rank <= 8"


def test_base_shape_does_not_fit(make_adapter, base) -> None:
    path = make_adapter()
    _validate(path, max_rank=8)
    wide = replace(base, hidden=128, intermediate=256, head_dim=32)
    err = _incompatible(path, "model.layers.0.self_attn.q_proj.lora_A/lora_B.weight", wide)
    assert "lora_A [r, 128]" in err.allowed


def test_more_layers_than_base(make_adapter, base) -> None:
    _incompatible(
        make_adapter(), "model.layers.1.self_attn.q_proj.lora_A.weight", replace(base, num_layers=1)
    )


def test_missing_layers_of_base(make_adapter, base) -> None:
    _incompatible(
        make_adapter(), "model.layers.2.self_attn.q_proj.lora_A.weight", replace(base, num_layers=3)
    )


def test_foreign_tensor_refused(make_adapter) -> None:
    path = make_adapter()
    _edit_tensors(
        path, lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)})
    )
    _incompatible(path, "base_model.model.lm_head.lora_A.weight")


def test_absurd_layer_index_refused_without_base(make_adapter) -> None:
    path = make_adapter()
    deep = "base_model.model.model.layers.5000000.self_attn.q_proj"
    _edit_tensors(path, lambda t: t.update({f"{deep}.lora_A.weight": torch.zeros(4, 64)}))
    assert _incompatible(path, "adapter_model.safetensors").problem == "names layer 5000000"


def test_unpaired_tensor_refused(make_adapter) -> None:
    path = make_adapter()
    _edit_tensors(path, lambda t: t.pop(f"{Q0}.lora_B.weight"))
    _incompatible(path, "model.layers.0.self_attn.q_proj.lora_B.weight")


def test_untargeted_tensor_refused(make_adapter) -> None:
    path = make_adapter()
    _edit(path, target_modules=["q_proj"])
    _incompatible(path, "model.layers.0.self_attn.v_proj.lora_A.weight")


def test_targeted_module_without_tensors_refused(make_adapter) -> None:
    path = make_adapter()
    _edit(path, target_modules=["q_proj", "v_proj", "k_proj"])
    err = _incompatible(path, "model.layers.0.self_attn.k_proj.lora_A.weight")
    assert "2 targeted modules have no tensors" in err.problem


def test_rank_mismatch_with_config(make_adapter) -> None:
    path = make_adapter()
    _edit(path, r=3)
    err = _incompatible(path, "model.layers.0.self_attn.q_proj.lora_A.weight")
    assert err.problem == "rank 4 but r says 3"


def test_inconsistent_a_b_shapes(make_adapter) -> None:
    path = make_adapter()
    _edit_tensors(path, lambda t: t.update({f"{Q0}.lora_B.weight": torch.zeros(64, 3)}))
    _incompatible(path, "model.layers.0.self_attn.q_proj.lora_B.weight")


def test_missing_config(make_adapter) -> None:
    path = make_adapter()
    (path / "adapter_config.json").unlink()
    with pytest.raises(AdapterLoadFailed, match="adapter_config.json is missing"):
        _validate(path, max_rank=8)


def test_corrupt_config(make_adapter) -> None:
    path = make_adapter()
    (path / "adapter_config.json").write_text('{"r": 4,')
    with pytest.raises(AdapterLoadFailed, match="cannot read"):
        _validate(path, max_rank=8)


def test_missing_weights(make_adapter) -> None:
    path = make_adapter()
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterLoadFailed, match="adapter_model.safetensors is missing"):
        _validate(path, max_rank=8)


def test_truncated_weights(make_adapter) -> None:
    path = make_adapter()
    file = path / "adapter_model.safetensors"
    file.write_bytes(file.read_bytes()[:-10])
    with pytest.raises(AdapterLoadFailed, match="corrupt safetensors"):
        _validate(path, max_rank=8)


def test_pickle_only_refused(make_adapter) -> None:
    path = make_adapter()
    file = path / "adapter_model.safetensors"
    torch.save(load_file(str(file)), path / "adapter_model.bin")
    file.unlink()
    with pytest.raises(AdapterLoadFailed, match="safetensors only"):
        _validate(path, max_rank=8)


@pytest.mark.parametrize("kind", ["missing", "file", "url", "hub"])
def test_path_must_be_a_local_directory(tmp_path: Path, kind: str) -> None:
    (tmp_path / "f").write_text("x")
    path = {
        "missing": str(tmp_path / "nope"),
        "file": str(tmp_path / "f"),
        "url": "https://huggingface.co/x/y",
        "hub": "someone/some-lora",
    }[kind]
    with pytest.raises(AdapterLoadFailed, match="allowed: an existing local directory"):
        _validate(path, max_rank=8)


def test_validate_is_torch_free() -> None:
    import subprocess
    import sys

    code = (
        "import sys, lora_core.validate, lora_core.peft_config, lora_core.safetensors_header;"
        "import lora_core.pool, lora_core.identity, lora_core.errors;"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.parametrize("dtype", [*WIDE_FLOATS, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_weights_are_refused(make_adapter, base, dtype, bad) -> None:
    if dtype == torch.float8_e4m3fn and math.isinf(bad):
        pytest.skip("float8_e4m3fn has no infinity (torch saturates it to 448)")
    path = make_adapter(target_modules=["q_proj", "v_proj"])
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"

    def poison(tensors):
        for k in tensors:
            tensors[k] = tensors[k].to(dtype)
        flat = tensors[name].view(-1)
        flat[torch.randint(flat.numel(), ()).item()] = bad

    _edit_tensors(path, poison)
    err = _incompatible(path, name, base)
    assert "NaN or infinite" in str(err)


@pytest.mark.parametrize("dtype", [*WIDE_FLOATS, torch.float8_e4m3fn, torch.float8_e5m2])
def test_extreme_finite_weights_pass(make_adapter, base, dtype) -> None:
    path = make_adapter(target_modules=["q_proj"])

    def extremes(tensors):
        info = torch.finfo(dtype)
        for k in tensors:
            t = tensors[k].to(dtype)
            t.view(-1)[:4] = torch.tensor([info.max, -info.max, info.tiny, 0.0], dtype=dtype)
            tensors[k] = t

    _edit_tensors(path, extremes)
    _validate(path, max_rank=8, base=base)
