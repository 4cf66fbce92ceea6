"""Every adapter refusal is a typed error naming the field, leaves slots untouched,
and the engine then serves a good request exactly as before."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lora_core.errors import AdapterIncompatible, AdapterLoadFailed
from lora_core.identity import AdapterRef
from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.offline import adapter_ref
from replica.sampling_params import SamplingParams
from tests.tiny import make_peft_adapter, make_tiny_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _edit_config(path, **changes):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def _dora(p):
    _edit_config(p, use_dora=True)


def _bias(p):
    _edit_config(p, bias="all")


def _modules_to_save(p):
    _edit_config(p, modules_to_save=["lm_head"])


def _missing_weights(p):
    (p / "adapter_model.safetensors").unlink()


def _missing_config(p):
    (p / "adapter_config.json").unlink()


def _corrupt_weights(p):
    f = p / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _corrupt_config(p):
    (p / "adapter_config.json").write_text("{not json")


def _pickle_only(p):
    from safetensors.torch import load_file

    tensors = load_file(str(p / "adapter_model.safetensors"))
    (p / "adapter_model.safetensors").unlink()
    torch.save(tensors, p / "adapter_model.bin")


CASES = [
    ("dora", _dora, AdapterIncompatible, "use_dora"),
    ("bias", _bias, AdapterIncompatible, "bias"),
    ("modules_to_save", _modules_to_save, AdapterIncompatible, "modules_to_save"),
    ("missing-weights", _missing_weights, AdapterLoadFailed, "adapter_model.safetensors"),
    ("missing-config", _missing_config, AdapterLoadFailed, "adapter_config.json"),
    ("corrupt-weights", _corrupt_weights, AdapterLoadFailed, "adapter_model.safetensors"),
    ("corrupt-config", _corrupt_config, AdapterLoadFailed, "adapter_config.json"),
    ("pickle", _pickle_only, AdapterLoadFailed, "safetensors"),
]


@pytest.fixture(scope="module")
def engine_and_good(llama_dir, llama_adapters):
    engine = LLMEngine(
        EngineConfig(
            model=str(llama_dir), device="cpu", max_loras=2, max_cpu_loras=3, max_lora_rank=16
        )
    )
    good = adapter_ref("good", llama_adapters["qv8"], max_rank=16)
    prompt = engine.tokenizer("hello world how are you").input_ids
    return engine, good, prompt, _generate(engine, "before", prompt, good)


def _generate(engine, rid, prompt, ref):
    engine.add_request(rid, prompt, GREEDY, ref)
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def _check_refused_then_serves(engine_and_good, bad: AdapterRef, error, field):
    engine, good, prompt, expected = engine_and_good
    before = engine.stats()
    with pytest.raises(error) as info:
        engine.add_request(f"bad-{bad.name}", prompt, GREEDY, bad)
    assert field in str(info.value)
    after = engine.stats()
    assert (after.gpu_adapters, after.cpu_adapters, after.free_slots) == (
        before.gpu_adapters,
        before.cpu_adapters,
        before.free_slots,
    )
    assert not engine.has_unfinished()
    assert _generate(engine, f"good-after-{bad.name}", prompt, good) == expected


@pytest.mark.parametrize("name,tamper,error,field", CASES, ids=[c[0] for c in CASES])
def test_file_and_config_refusals(
    engine_and_good, llama_adapters, tmp_path, name, tamper, error, field
):
    path = tmp_path / name
    shutil.copytree(llama_adapters["qv8"], path)
    tamper(path)
    bad = AdapterRef(name, 1, "0" * 64, str(path), 8)
    _check_refused_then_serves(engine_and_good, bad, error, field)


def test_target_module_the_base_lacks(engine_and_good, llama_dir, tmp_path):
    path = make_peft_adapter(
        llama_dir, tmp_path / "lmhead", r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]
    )
    _check_refused_then_serves(
        engine_and_good,
        AdapterRef("lmhead", 1, "0" * 64, str(path), 4),
        AdapterIncompatible,
        "lm_head",
    )


def test_rank_above_max_lora_rank(engine_and_good, llama_dir, tmp_path):
    path = make_peft_adapter(
        llama_dir, tmp_path / "r32", r=32, lora_alpha=32, target_modules=["q_proj"]
    )
    _check_refused_then_serves(
        engine_and_good, AdapterRef("r32", 1, "0" * 64, str(path), 32), AdapterIncompatible, "r"
    )


def test_shapes_that_do_not_fit_the_base(engine_and_good, tmp_path):
    other = make_tiny_model(tmp_path / "wide", "llama", seed=3, hidden=96, heads=4, kv_heads=2)
    path = make_peft_adapter(
        other, tmp_path / "wide-adapter", r=4, lora_alpha=8, target_modules=["q_proj"]
    )
    _check_refused_then_serves(
        engine_and_good,
        AdapterRef("wide", 1, "0" * 64, str(path), 4),
        AdapterIncompatible,
        "q_proj",
    )
