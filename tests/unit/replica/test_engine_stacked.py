"""The stacked layout (EngineConfig.lora_stacked: the slots' A under each base weight, the
shrink inside the base GEMM) generates what the two-kernel layout does and what HF
transformers + PEFT does, token for token in float32, for a batch mixing adapters of
different ranks and targets with the base model, across slot turns (adapters evicted and
written again into the same rows of the stacked weight)."""

from __future__ import annotations

import pytest

from lora_core.errors import InvalidRequest
from replica.config import EngineConfig
from replica.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy
from tests.tiny import run_requests
from tests.unit.replica.engines import small_engine

PROMPTS = ["the quick brown fox", "hello world how are you", "tenants share one base"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _batch(engine, refs, names):
    reqs = [
        (f"{i}-{name}", PROMPTS[i % len(PROMPTS)], GREEDY, refs[name] if name else None)
        for i, name in enumerate(names)
    ]
    return run_requests(engine, reqs)


def test_stacked_equals_two_kernels_and_hf(llama_dir, llama_adapters, refs):
    names = [None, *refs, *refs]  # every adapter twice, beside the base model
    # 2 slots for 4+ adapters: the run turns slots over, rewriting the stacked rows
    stacked = _batch(small_engine(llama_dir, lora_stacked=True), refs, names)
    assert stacked == _batch(small_engine(llama_dir), refs, names)
    engine = small_engine(llama_dir, lora_stacked=True)
    for name in refs:
        ids = engine.tokenizer(PROMPTS[0]).input_ids
        want = hf_greedy(llama_dir, llama_adapters[name], ids, max_new_tokens=12,
                         min_new_tokens=12)  # fmt: skip
        got = run_requests(engine, [("r", PROMPTS[0], GREEDY, refs[name])])["r"]
        assert got == want, name


def test_stacked_needs_one_tensor_parallel_rank(llama_dir):
    with pytest.raises(InvalidRequest, match="lora_stacked only with tensor_parallel_size 1"):
        EngineConfig(model=str(llama_dir), lora_stacked=True, tensor_parallel_size=2)
