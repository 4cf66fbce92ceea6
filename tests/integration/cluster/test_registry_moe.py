"""Registering adapters of a mixture-of-experts base (Mixtral, Qwen2-MoE; real Redis):
where the base's shape is known (the cluster's published served base, or a shape stored
under `--base-model`), an adapter reaching the router, the experts (or a Qwen2-MoE's
shared expert) is refused at registration, before anything is
stored, with the same message the engine gives (REST, the registry and the admin CLI);
q/k/v/o adapters register. With no shape known, validation has no base to check against:
a dense-MLP adapter registers, and the replica refuses it when it loads it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.records import ServedBase
from cluster.registry import AsyncRegistry, Registry
from lora_core.errors import AdapterIncompatible
from router.admin import load_adapter
from router.admin_bodies import LoadAdapterRequest
from tests.redis_fixture import dump_redis
from tests.tiny import make_peft_adapter

ROOT = Path(__file__).resolve().parents[3]
ATTENTION = "q_proj, k_proj, v_proj, o_proj"
DENSE_MLP = (
    "target_modules: matches 'model.layers.0.mlp.gate_proj': MixtralForCausalLM is a "
    "mixture-of-experts model whose router and experts take no LoRA; allowed: "
    f"{ATTENTION} (attention)"
)
EXPERTS = (
    "target_parameters: ['mlp.experts.down_proj'] targets parameters (as peft does for "
    "mixture-of-experts expert weights), which this engine cannot adapt; allowed: null or "
    f"[]; LoRA through target_modules on {ATTENTION} (attention)"
)


@pytest.fixture(scope="module")
def refused(mixtral_dir, llama_adapters, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """name -> (adapter dir, the refusal's text): a same-sized Llama adapter of q/k/v/o and
    gate/up/down, and a Mixtral adapter of q_proj and the experts' down_proj."""
    experts = make_peft_adapter(
        mixtral_dir, tmp_path_factory.mktemp("moe") / "experts", r=4, lora_alpha=8,
        target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"],
    )  # fmt: skip
    return {"dense-mlp": (llama_adapters["all16rs"], DENSE_MLP), "experts": (experts, EXPERTS)}


@pytest.fixture
def served(mixtral_dir) -> ServedBase:
    return ServedBase.from_model_dir("mixtral", str(mixtral_dir), max_lora_rank=16, max_loras=2)


@pytest.mark.parametrize("case", ["dense-mlp", "experts"])
def test_registry_and_rest_refuse_before_storing(
    registry: Registry, redis_url, served, refused, mixtral_adapters, case
):
    path, message = refused[case]
    registry.set_served(served)
    before = dump_redis(redis_url)
    with pytest.raises(AdapterIncompatible) as e:
        registry.register_adapter("bad", str(path), served=served)
    assert str(e.value) == message

    async def rest() -> AdapterIncompatible:
        reg = AsyncRegistry(redis_url, "t", max_lora_rank=16)
        try:
            await load_adapter(
                reg, served, LoadAdapterRequest(lora_name="bad", lora_path=str(path))
            )
        except AdapterIncompatible as err:
            return err
        finally:
            await reg.close()
        raise AssertionError("registered")

    err = asyncio.run(rest())
    assert (str(err), err.param) == (message, "lora_path")
    assert dump_redis(redis_url) == before
    rec = registry.register_adapter("qv8", str(mixtral_adapters["qv8"]), served=served)
    assert (rec.base_model, rec.target_modules) == ("mixtral", ("q_proj", "v_proj"))


def _cli(redis_url: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LORAFLEET_NAMESPACE": "t"}
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", *argv, "--redis-url", redis_url],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_cli_refuses_where_the_shape_is_known(registry: Registry, redis_url, served, refused):
    """The served base (a running cluster), or without one the shape stored under
    --base-model; with neither, the dense-MLP adapter registers (no shape to check)."""
    path, message = refused["dense-mlp"]
    res = _cli(redis_url, "adapters", "register", "unchecked", str(path), "--base-model", "m")
    assert res.returncode == 0, res.stderr
    registry.set_base_shape("mixtral", served.shape)
    res = _cli(redis_url, "adapters", "register", "bad", str(path), "--base-model", "mixtral")
    assert (res.returncode, res.stderr) == (1, f"lorafleet: error: {message}\n")
    registry.set_served(served)
    res = _cli(redis_url, "adapters", "register", "bad", str(path))
    assert (res.returncode, res.stderr) == (1, f"lorafleet: error: {message}\n")


def test_a_qwen2_moe_base_refuses_its_shared_expert_and_dense_mlps(
    registry: Registry, redis_url, qwen2_moe_dir, qwen2_moe_adapters, tmp_path
):
    """The same refusal for a Qwen2-MoE served base, naming its shared expert's gate (what
    peft's "all-linear" adapts besides attention) and what takes no LoRA there."""
    served = ServedBase.from_model_dir(
        "qwen2-moe", str(qwen2_moe_dir), max_lora_rank=16, max_loras=2
    )
    registry.set_served(served)
    path = make_peft_adapter(
        qwen2_moe_dir, tmp_path / "all", r=4, lora_alpha=8, target_modules="all-linear"
    )
    before = dump_redis(redis_url)
    with pytest.raises(AdapterIncompatible) as e:
        registry.register_adapter("bad", str(path), served=served)
    if json.loads((path / "adapter_config.json").read_text()).get("target_parameters"):
        # peft >= 0.22 turns "all-linear"'s fused experts into target_parameters: refused first
        assert str(e.value).startswith("target_parameters: ") and "expert weights" in str(e.value)
    else:
        assert str(e.value) == (
            "target_modules: matches 'model.layers.0.mlp.shared_expert_gate': Qwen2MoeForCausalLM "
            "is a mixture-of-experts model whose router, experts, shared expert and dense MLP "
            f"layers take no LoRA; allowed: {ATTENTION} (attention)"
        )
    assert dump_redis(redis_url) == before
    rec = registry.register_adapter("qv8", str(qwen2_moe_adapters["qv8"]), served=served)
    assert (rec.base_model, rec.target_modules) == ("qwen2-moe", ("q_proj", "v_proj"))
