"""The engine on CUDA (Triton LoRA kernels): float32 greedy tokens equal the CPU engine's
(which equal HF + PEFT), mixed adapters and base in one batch; bf16/fp16 runs stay close."""

from __future__ import annotations

import pytest
import torch

from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.offline import adapter_ref
from replica.sampling_params import SamplingParams
from tests.gpu.engine_runs import run_engine

pytestmark = pytest.mark.gpu

PROMPTS = [
    "hello world how are you",
    "the quick brown fox jumps",
    "what is lorafleet a multi tenant lora",
]


def _run(
    model_dir, refs, device: str, dtype: str, graphs: bool = True, layout: str = "two-kernels"
) -> list[list[int]]:
    out = run_engine(
        model_dir, refs, PROMPTS, device, dtype, graphs=graphs, stacked=layout == "stacked"
    )
    return list(out.values())


@pytest.fixture(scope="module")
def refs(llama_adapters):
    return {n: adapter_ref(n, p, max_rank=16) for n, p in llama_adapters.items()}


@pytest.mark.parametrize("layout", ["two-kernels", "stacked"])
@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "eager"])
def test_cuda_float32_equals_cpu(llama_dir, refs, graphs, layout):
    assert torch.cuda.is_available()
    cpu = _run(llama_dir, refs, "cpu", "float32")
    cuda = _run(llama_dir, refs, "cuda", "float32", graphs, layout)
    assert cuda == cpu


# (model fixture, adapters fixture): Qwen 2's q/k/v biases; Qwen 3's q/k norms and
# head_dim 24 (not hidden / heads), without and with biases on q, k, v and o.
ARCHS = {
    "qwen2": ("qwen2_dir", "qwen2_adapters"),
    "qwen3": ("qwen3_dir", "qwen3_adapters"),
    "qwen3-bias": ("qwen3_bias_dir", "qwen3_adapters"),
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_cuda_float32_other_architectures_equal_cpu(request, arch):
    model_fixture, adapters_fixture = ARCHS[arch]
    model_dir = request.getfixturevalue(model_fixture)
    adapters = request.getfixturevalue(adapters_fixture)
    refs = {n: adapter_ref(n, p, max_rank=16) for n, p in adapters.items()}
    cpu = run_engine(model_dir, refs, PROMPTS, "cpu")
    assert run_engine(model_dir, refs, PROMPTS, "cuda", graphs=True) == cpu
    assert run_engine(model_dir, refs, PROMPTS, "cuda", graphs=False) == cpu


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_half_precision_runs_and_mostly_agrees(llama_dir, refs, dtype):
    cpu = _run(llama_dir, refs, "cpu", "float32")
    half = _run(llama_dir, refs, "cuda", dtype)
    first_equal = sum(a[:2] == b[:2] for a, b in zip(cpu, half, strict=True))
    assert first_equal >= 0.8 * len(cpu)


def _scored(model_dir, refs, device: str) -> dict[str, tuple[list[int], list[float]]]:
    """Requests with prompt logprobs (chunked), min_tokens with stop ids and plain ones in
    one batch, with CUDA graphs on: -> (generated ids, prompt logprobs) per request."""
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir), device=device, dtype="float32", max_loras=2,
            max_cpu_loras=3, max_lora_rank=16, max_num_batched_tokens=8,
        )
    )  # fmt: skip
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    scored = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    held = SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=(3, 5, 7), min_tokens=6
    )
    name = next(iter(refs))
    reqs = [("plain", plain, None), ("scored", scored, refs[name]), ("held", held, refs[name])]
    reqs.append(("prompt-only", SamplingParams(max_tokens=0, prompt_logprobs=0), None))
    for rid, params, ref in reqs:
        engine.add_request(rid, engine.tokenizer(PROMPTS[2]).input_ids, params, ref)
    out = {rid: ([], []) for rid, _, _ in reqs}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(o.prompt_logprobs or [])
    return out


def test_cuda_prompt_logprobs_and_min_tokens_equal_cpu(llama_dir, refs):
    """The GPU paths of this feature set: prompt-logprob rows (their steps skip the CUDA
    graphs), the min_tokens bans in the logits plan, max_tokens 0."""
    cpu, cuda = _scored(llama_dir, refs, "cpu"), _scored(llama_dir, refs, "cuda")
    for rid in cpu:
        assert cuda[rid][0] == cpu[rid][0], rid
        assert cuda[rid][1] == pytest.approx(cpu[rid][1], abs=1e-4), rid
    assert len(cpu["scored"][1]) == len(cpu["prompt-only"][1]) > 0
    assert cpu["prompt-only"][0] == []
