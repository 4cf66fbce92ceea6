"""A Mixtral engine in float32 generates HF transformers' (+ PEFT's, for adapters on
q/k/v/o) greedy tokens, token for token, with base requests and three adapters mixed in
one batch (two slots, so slots are rewritten): from both checkpoint namings, with 4 and 8
experts, with each MoE compute path (grouped, dense-masked, fused: the Triton kernels
in the interpreter where there is no GPU, the torch reference else) forced, and with the
stacked LoRA layout. An adapter on the MLP side is refused by the engine."""

from __future__ import annotations

import json
import os

import pytest

from lora_core.errors import AdapterIncompatible
from replica.models.moe import SparseMoE
from replica.offline import adapter_ref
from replica.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, hf_greedy_batch
from tests.tiny import make_tiny_mixtral, mixed_requests, run_requests, with_mlp_lora
from tests.unit.replica.engines import small_engine

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)  # stops at EOS, as HF does
PROMPTS = ["hello world how are you", "the quick brown fox jumps over", "what is lorafleet"]


@pytest.fixture(scope="module")
def models(mixtral_dir, tiny_dir) -> dict:
    return {
        "e4": mixtral_dir,
        "e4-fused": make_tiny_mixtral(tiny_dir / "mixtral-fused", seed=5, fused=True),
        "e8": make_tiny_mixtral(tiny_dir / "mixtral-e8", seed=6, experts=8),
    }


@pytest.fixture(scope="module")
def references() -> dict:
    """{model: HF's tokens}, filled by the first test of each model."""
    return {}


# (model, compute path, lora_stacked)
CASES = [(m, c, False) for m in ("e4", "e4-fused", "e8") for c in ("auto", "grouped", "dense")]
CASES += [("e4", "auto", True), ("e4", "fused", False)]


@pytest.mark.parametrize(("model", "compute", "stacked"), CASES)
def test_mixed_batch_equals_hf(
    monkeypatch, models, mixtral_adapters, references, model, compute, stacked
):
    if compute == "fused" and os.environ.get("TRITON_INTERPRET") == "1":
        monkeypatch.setenv("LORAFLEET_KERNELS", "triton")  # kernels.fused_moe's Triton kernels
    model_dir = models[model]
    engine = small_engine(model_dir, lora_stacked=stacked)
    blocks = [m for m in engine.runner.model.modules() if isinstance(m, SparseMoE)]
    assert len(blocks) == 2
    for block in blocks:
        block.compute = compute
    refs = {n: adapter_ref(n, p, max_rank=16) for n, p in mixtral_adapters.items()}
    got = run_requests(engine, mixed_requests(PROMPTS, GREEDY, refs))
    assert engine.stats().adapter_loads > 2  # three adapters through two slots
    if model not in references:
        references[model] = hf_greedy_batch(
            model_dir, mixtral_adapters, engine.tokenizer, PROMPTS, MAX_NEW
        )
    assert got == references[model]


def test_engine_refuses_an_adapter_on_the_experts(mixtral_dir, mixtral_adapters, tmp_path):
    """Validated without the base (adapter_ref, as the registry may), an adapter with
    LoRA on a dense MLP's projections (what a Llama's would be) reaches the engine, which
    refuses it against its Mixtral and serves the next request as before."""
    path = with_mlp_lora(mixtral_adapters["qv8"], tmp_path / "mlp", 2, 64, 128)
    engine = small_engine(mixtral_dir)
    good = adapter_ref("good", mixtral_adapters["qv8"], max_rank=16)
    before = run_requests(engine, [("a", PROMPTS[0], GREEDY, good)])
    with pytest.raises(AdapterIncompatible) as e:
        engine.add_request("bad", [5, 6, 7], GREEDY, adapter_ref("mlp", path, max_rank=16))
    assert "'model.layers.0.mlp.gate_proj': MixtralForCausalLM is a mixture-of-experts" in str(
        e.value
    )
    assert run_requests(engine, [("b", PROMPTS[0], GREEDY, good)]) == {"b": before["a"]}


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_sliding_window_equals_hf(tmp_path, monkeypatch, backend):
    """Mixtral's attention is Mistral's: a sliding_window applies to every layer. triton:
    kernels.paged_attention's window in the CPU interpreter (prompt chunks and decode)."""
    if backend == "triton":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs the Triton interpreter (a CPU machine)")
        monkeypatch.setenv("LORAFLEET_KERNELS", backend)
    model_dir = make_tiny_mixtral(tmp_path / "m", seed=8)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["sliding_window"] = 6
    (model_dir / "config.json").write_text(json.dumps(cfg))
    ids = list(range(100, 130))
    engine = small_engine(model_dir)
    engine.add_request("r", ids, SamplingParams(max_tokens=8, temperature=0.0))
    got = []
    while engine.has_unfinished():
        got += [t for o in engine.step() for t in o.new_token_ids]
    assert got == hf_greedy(model_dir, None, ids, max_new_tokens=8)
