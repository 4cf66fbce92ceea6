"""EngineConfig.lora_overlap: each LoRA layer runs its shrink, its base GEMM, then its
expand (on CUDA the shrink on a side stream beside the GEMM). On CPU the same calls run
in order on one stream, so these tests check the path's wiring (workspace, shrink output
into the expand) against HF transformers + PEFT and the default layout, token for token
in float32; tests/gpu/test_engine_cuda.py runs it with its streams, eager and in CUDA
graphs, against the CPU engine."""

from __future__ import annotations

import pytest
import torch

from lora_core.context import LoraBatchContext
from lora_core.errors import InvalidRequest
from replica.config import EngineConfig
from replica.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy
from tests.tiny import run_requests
from tests.unit.replica.engines import small_engine

PROMPTS = ["the quick brown fox", "hello world how are you", "tenants share one base"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_overlap_equals_the_default_layout_and_hf(llama_dir, llama_adapters, refs):
    names = [None, *refs, *refs]  # every adapter twice beside the base model; 2 slots
    reqs = [
        (f"{i}-{n}", PROMPTS[i % len(PROMPTS)], GREEDY, refs[n] if n else None)
        for i, n in enumerate(names)
    ]
    engine = small_engine(llama_dir, lora_overlap=True)
    assert engine.runner.lora_ctx.overlap and engine.runner.lora_ctx.side_stream is None
    assert run_requests(engine, reqs) == run_requests(small_engine(llama_dir), reqs)
    for name in refs:
        ids = engine.tokenizer(PROMPTS[0]).input_ids
        want = hf_greedy(llama_dir, llama_adapters[name], ids, max_new_tokens=10,
                         min_new_tokens=10)  # fmt: skip
        assert run_requests(engine, [("r", PROMPTS[0], GREEDY, refs[name])])["r"] == want


def test_overlap_and_stacked_are_refused_together(llama_dir):
    with pytest.raises(InvalidRequest, match="lora_stacked with lora_overlap"):
        EngineConfig(model=str(llama_dir), lora_stacked=True, lora_overlap=True)


def test_no_side_stream_off_cuda():
    ctx = LoraBatchContext(8, "cpu", torch.zeros(2, dtype=torch.int32), 4, overlap=True)
    assert ctx.overlap and ctx.side_stream is None and ctx.fork is None and ctx.join is None
