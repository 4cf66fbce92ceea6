"""build_app refuses, before anything starts, a model config the replicas would refuse at
their start (Serve would retry them forever while the ingress answers): a tensor-parallel
split the heads (or a Mixtral's experts) do not allow, a context past the model's
positions, a KV cache too small for one request of the context length."""

import json

import pytest

from deploy.model_checks import check_model_fits, kv_cache_room
from lora_core.errors import InvalidRequest
from replica.config import EngineConfig
from tests.tiny import make_tiny_mixtral


def engine(model_dir, **fields) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", **fields)


def test_a_fitting_config_passes_with_its_context_length(llama_dir):
    native = json.loads((llama_dir / "config.json").read_text())["max_position_embeddings"]
    assert check_model_fits(engine(llama_dir, kv_cache_tokens=native)) == native
    assert check_model_fits(engine(llama_dir, max_model_len=64, kv_cache_tokens=64)) == 64


def test_the_kv_cache_holds_whole_blocks(llama_dir):
    assert kv_cache_room(engine(llama_dir, kv_cache_tokens=100, block_size=16)) == 112
    assert kv_cache_room(engine(llama_dir, num_kv_blocks=3, block_size=16)) == 48


def test_a_kv_cache_smaller_than_one_context_is_refused(llama_dir):
    native = json.loads((llama_dir / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(InvalidRequest) as e:
        check_model_fits(engine(llama_dir, kv_cache_tokens=32, block_size=16))
    assert str(e.value) == (
        f"kv_cache_tokens=32: the KV cache (32 tokens) cannot hold one request of the "
        f"context length (the model's: {native}); allowed: "
        f"kv_cache_tokens >= {native}, or max_model_len <= 32"
    )
    with pytest.raises(InvalidRequest, match=r"\(max_model_len: 64\)"):
        check_model_fits(engine(llama_dir, max_model_len=64, kv_cache_tokens=48, block_size=16))


def test_a_split_the_heads_do_not_allow_and_a_context_past_the_model_are_refused(llama_dir):
    with pytest.raises(InvalidRequest, match="is not divisible by tensor_parallel_size=3"):
        check_model_fits(engine(llama_dir, tensor_parallel_size=3))
    with pytest.raises(InvalidRequest, match="exceeds the model's context length=1024"):
        check_model_fits(engine(llama_dir, max_model_len=10**6))


def test_a_mixtral_is_split_by_whole_experts(tmp_path):
    """tensor_parallel_size must divide a Mixtral's expert count (each rank holds whole
    experts), not its intermediate size; the refusal names both sizes."""
    six = make_tiny_mixtral(tmp_path / "e6", seed=1, experts=6)
    raw = json.loads((six / "config.json").read_text())
    raw["intermediate_size"] = 127  # the check reads config.json alone
    (six / "config.json").write_text(json.dumps(raw))
    assert check_model_fits(engine(six, tensor_parallel_size=2, kv_cache_tokens=1024)) == 1024
    three = make_tiny_mixtral(tmp_path / "e3", seed=1, experts=3)
    with pytest.raises(InvalidRequest) as e:
        check_model_fits(engine(three, tensor_parallel_size=2, kv_cache_tokens=1024))
    assert str(e.value) == (
        "num_local_experts=3 is not divisible by tensor_parallel_size=2; allowed: a "
        "tensor_parallel_size dividing num_attention_heads=4, num_key_value_heads=2, "
        "num_local_experts=3"
    )
