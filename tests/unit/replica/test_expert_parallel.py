"""Expert parallelism on CPU (gloo): a Mixtral sharded 2 ways (attention head-sharded,
each rank holding half the experts whole) gives the unsharded model's greedy tokens
through the engine with adapters mixed in one batch (the forward level, logits
included: test_tensor_parallel's test_tp2_forward_equals_tp1); an expert count the
group cannot split is refused before anything starts, naming the sizes."""

from __future__ import annotations

import json

import pytest

from lora_core.errors import InvalidRequest
from replica.models.config import ModelConfig
from replica.offline import adapter_ref
from replica.sampling_params import SamplingParams
from tests.tiny import make_tiny_mixtral, run_requests
from tests.unit.replica.engines import small_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = ["hello world how are you", "the quick brown fox jumps over"]


def test_tp2_engine_equals_tp1(mixtral_dir, mixtral_adapters):
    refs = {n: adapter_ref(n, p, max_rank=16) for n, p in mixtral_adapters.items()}
    requests = [
        (f"{name or 'base'}-{i}", prompt, GREEDY, refs[name] if name else None)
        for i, prompt in enumerate(PROMPTS)
        for name in (None, *refs)
    ]
    want = run_requests(small_engine(mixtral_dir), requests)
    engine = small_engine(mixtral_dir, tensor_parallel_size=2)
    procs = engine.runner.driver.procs
    try:
        got = run_requests(engine, requests)
        assert engine.stats().adapter_loads > 2  # slots rewritten on both ranks
    finally:
        engine.close()
    assert got == want
    assert [p.returncode for p in procs] == [0]


def test_experts_not_divisible_refused_before_start(tmp_path):
    model_dir = make_tiny_mixtral(tmp_path / "e3", seed=7, experts=3)
    with pytest.raises(InvalidRequest) as e:
        small_engine(model_dir, tensor_parallel_size=2)
    assert str(e.value).startswith(
        "num_local_experts=3 is not divisible by tensor_parallel_size=2; allowed: a "
        "tensor_parallel_size dividing num_attention_heads=4, num_key_value_heads=2, "
        "num_local_experts=3"
    )


def test_expert_parallel_does_not_split_the_intermediate(mixtral_dir):
    """Experts are held whole: an intermediate_size no tp divides does not matter."""
    raw = json.loads((mixtral_dir / "config.json").read_text())
    cfg = ModelConfig.from_hf({**raw, "intermediate_size": 99, "num_local_experts": 8})
    cfg.check_tensor_parallel(2)
    with pytest.raises(InvalidRequest, match="num_local_experts=8 is not divisible by .*=16"):
        ModelConfig.from_hf({**raw, "num_attention_heads": 16, "num_key_value_heads": 16,
                             "num_local_experts": 8}).check_tensor_parallel(16)  # fmt: skip
