"""Mixtral, Qwen3-MoE (a dense MLP layer, q/k norms) and Qwen2-MoE (a shared expert, a
dense MLP layer) engines on CUDA: float32 greedy tokens equal the CPU engine's and HF +
PEFT's, base and adapters (on q/k/v/o) mixed in one batch, with decode replayed from
CUDA graphs and eager (both take the MoE's fused Triton kernels by default), and with
each compute path forced (dense-masked captured too; grouped eager only); bf16 runs stay
close."""

from __future__ import annotations

import pytest
import torch

from replica.offline import adapter_ref
from tests.gpu.engine_runs import run_engine
from tests.hf_reference import hf_greedy
from tests.tiny import make_tiny_mixtral

pytestmark = pytest.mark.gpu

PROMPTS = ["hello world how are you", "the quick brown fox jumps", "what is lorafleet"]
MAX_NEW = 12


def _run(
    model_dir, refs, device: str, dtype: str = "float32", graphs: bool = True, compute="auto"
) -> dict[str, list[int]]:
    return run_engine(
        model_dir, refs, PROMPTS, device, dtype, graphs=graphs, compute=compute,
        max_tokens=MAX_NEW, ignore_eos=False,  # stops at EOS, as HF does
        moe_path="fused" if compute == "auto" and device == "cuda" else None,
    )  # fmt: skip


MODELS = ["e4", "e8", "qwen3_moe", "qwen2_moe"]


@pytest.fixture(scope="module")
def models(request, tiny_dir) -> dict:
    """{model: (model dir, its adapters {name: path})}."""
    mixtral = request.getfixturevalue("mixtral_adapters")
    e8 = make_tiny_mixtral(tiny_dir / "mixtral-e8", seed=6, experts=8)
    out = {"e4": (request.getfixturevalue("mixtral_dir"), mixtral), "e8": (e8, mixtral)}
    for arch in ("qwen3_moe", "qwen2_moe"):
        adapters = request.getfixturevalue(f"{arch}_adapters")
        out[arch] = (request.getfixturevalue(f"{arch}_dir"), adapters)
    return out


def _refs(adapters: dict) -> dict:
    return {n: adapter_ref(n, p, max_rank=16) for n, p in adapters.items()}


@pytest.fixture(scope="module")
def expected(models) -> dict:
    """{model: the CPU engine's tokens}, checked once against HF + PEFT."""
    from transformers import AutoTokenizer

    out = {}
    for name, (model_dir, adapters) in models.items():
        refs = _refs(adapters)
        cpu = _run(model_dir, refs, "cpu")
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        for i, prompt in enumerate(PROMPTS):
            for n in (None, *refs):
                path = adapters[n] if n else None
                ids = tok(prompt).input_ids
                assert cpu[f"{i}-{n}"] == hf_greedy(model_dir, path, ids, max_new_tokens=MAX_NEW)
        out[name] = cpu
    return out


# The grouped path reads expert counts on the host: it is never captured. auto is fused.
PATHS = [(True, "auto"), (True, "dense"), (False, "auto"), (False, "grouped"), (False, "dense")]


@pytest.mark.parametrize(
    ("graphs", "compute"), PATHS, ids=[f"{'graphs' if g else 'eager'}-{c}" for g, c in PATHS]
)
@pytest.mark.parametrize("model", MODELS)
def test_cuda_float32_equals_cpu_and_hf(models, expected, model, graphs, compute):
    assert torch.cuda.is_available()
    model_dir, adapters = models[model]
    got = _run(model_dir, _refs(adapters), "cuda", graphs=graphs, compute=compute)
    assert got == expected[model]


@pytest.mark.parametrize("model", ["e4", "qwen3_moe", "qwen2_moe"])
def test_cuda_bfloat16_runs_and_mostly_agrees(models, expected, model):
    model_dir, adapters = models[model]
    half = _run(model_dir, _refs(adapters), "cuda", "bfloat16")
    cpu = expected[model]
    first_equal = sum(half[rid][:2] == cpu[rid][:2] for rid in cpu)
    assert first_equal >= 0.8 * len(cpu)
