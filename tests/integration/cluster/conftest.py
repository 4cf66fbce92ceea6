"""Fixtures of the cluster integration tests: real redis-server, real PEFT adapters."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cluster.registry import Registry
from tests.redis_fixture import redis_server, redis_url  # noqa: F401

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=256,
)


def _save_peft(path: Path, seed: int, r: int, targets: list[str]) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False)
    get_peft_model(model, cfg).save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two valid rank-8 adapters (different weights) and one rank-4 one, built once."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": _save_peft(root / "a", seed=0, r=8, targets=["q_proj", "v_proj"]),
        "b": _save_peft(root / "b", seed=1, r=8, targets=["q_proj", "v_proj"]),
        "small": _save_peft(root / "small", seed=2, r=4, targets=["o_proj", "down_proj"]),
    }


def _edit_config(path: Path, **changes: object) -> None:
    cfg_path = path / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(changes)
    cfg_path.write_text(json.dumps(cfg))


def _truncate_weights(path: Path) -> None:
    w = path / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[:40])


def _pickle_only(path: Path) -> None:
    w = path / "adapter_model.safetensors"
    w.rename(path / "adapter_model.bin")


BROKEN: dict[str, Callable[[Path], None]] = {
    "dora": lambda p: _edit_config(p, use_dora=True),
    "bias": lambda p: _edit_config(p, bias="all"),
    "modules_to_save": lambda p: _edit_config(p, modules_to_save=["lm_head"]),
    "missing_config": lambda p: (p / "adapter_config.json").unlink(),
    "missing_weights": lambda p: (p / "adapter_model.safetensors").unlink(),
    "corrupt_weights": _truncate_weights,
    "pickle_weights": _pickle_only,
}


@pytest.fixture(scope="session")
def broken_adapters(adapters: dict[str, Path], tmp_path_factory) -> dict[str, Path]:
    """Copies of adapter "a", each broken one way the registry must refuse."""
    root = tmp_path_factory.mktemp("broken")
    out = {}
    for kind, breaker in BROKEN.items():
        dst = shutil.copytree(adapters["a"], root / kind)
        breaker(dst)
        out[kind] = dst
    return out


@pytest.fixture
def registry(redis_url: str) -> Iterator[Registry]:  # noqa: F811
    reg = Registry(redis_url, namespace="t", max_lora_rank=16)
    yield reg
    reg.close()
