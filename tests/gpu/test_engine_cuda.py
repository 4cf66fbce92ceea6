"""The engine on CUDA (Triton LoRA kernels): float32 greedy tokens equal the CPU engine's
(which equal HF + PEFT), mixed adapters and base in one batch; bf16/fp16 runs stay close."""

from __future__ import annotations

import pytest
import torch

from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.offline import adapter_ref
from replica.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [
    "hello world how are you",
    "the quick brown fox jumps",
    "what is lorafleet a multi tenant lora",
]


def _run(model_dir, refs, device: str, dtype: str) -> list[list[int]]:
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device=device,
            dtype=dtype,
            max_loras=2,
            max_cpu_loras=3,
            max_lora_rank=16,
        )
    )
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    names = [None, *refs]
    reqs = [(f"{i}-{n}", p, refs.get(n)) for i, p in enumerate(PROMPTS) for n in names]
    for rid, p, ref in reqs:
        engine.add_request(rid, engine.tokenizer(p).input_ids, params, ref)
    out = {rid: [] for rid, _, _ in reqs}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[rid] for rid, _, _ in reqs]


@pytest.fixture(scope="module")
def refs(llama_adapters):
    return {n: adapter_ref(n, p, max_rank=16) for n, p in llama_adapters.items()}


def test_cuda_float32_equals_cpu(llama_dir, refs):
    assert torch.cuda.is_available()
    cpu = _run(llama_dir, refs, "cpu", "float32")
    cuda = _run(llama_dir, refs, "cuda", "float32")
    assert cuda == cpu


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_half_precision_runs_and_mostly_agrees(llama_dir, refs, dtype):
    cpu = _run(llama_dir, refs, "cpu", "float32")
    half = _run(llama_dir, refs, "cuda", dtype)
    first_equal = sum(a[:2] == b[:2] for a, b in zip(cpu, half, strict=True))
    assert first_equal >= 0.8 * len(cpu)
