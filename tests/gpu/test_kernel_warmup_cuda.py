"""EngineConfig.kernel_warmup on CUDA: once the engine is built, serving mixed-adapter
prefill, mixed and decode steps compiles no Triton kernel (every JIT kernel of
kernels.triton keeps the binaries it had at start); with the warm-up off the same run
compiles some, which shows the count can see a compile."""

from __future__ import annotations

import time

import pytest
import torch

from kernels.testing import compiled_binaries
from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.offline import adapter_ref
from replica.sampling_params import SamplingParams
from tests.tiny import run_requests

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = ["hello world how are you", "the quick brown fox jumps over the lazy dog and", "what"]


def _serve(model_dir, refs: dict, dtype: str, warmup: bool) -> tuple[float, int]:
    """-> (seconds to build the engine, binaries compiled while serving)."""
    started = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir), device="cuda", dtype=dtype, max_loras=4, max_cpu_loras=4,
            max_lora_rank=16, max_num_seqs=8, max_num_batched_tokens=96, kernel_warmup=warmup,
        )
    )  # fmt: skip
    built = time.perf_counter() - started
    before = compiled_binaries()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    names = [None, *refs]
    reqs = [(f"{i}", PROMPTS[i % 3], params, refs.get(names[i % len(names)])) for i in range(8)]
    run_requests(engine, reqs)
    assert engine.runner.graphs.replays > 0 and engine.runner.mixed.replays > 0
    return built, compiled_binaries() - before


def test_serving_compiles_nothing_after_a_warm_start(llama_dir, llama_adapters):
    refs = {n: adapter_ref(n, p, max_rank=16) for n, p in llama_adapters.items()}
    built, compiled = _serve(llama_dir, refs, "bfloat16", warmup=True)
    cold_built, cold_compiled = _serve(llama_dir, refs, "float16", warmup=False)
    print(
        f"warm start {built:.2f} s, compiled while serving {compiled}; "
        f"without warm-up {cold_built:.2f} s, compiled while serving {cold_compiled}"
    )
    assert compiled == 0
    assert cold_compiled > 0
