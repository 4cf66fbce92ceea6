"""Qwen3-MoE and Qwen2-MoE engines in float32 generate HF transformers' (+ PEFT's, for
adapters on q/k/v/o) greedy tokens, token for token, with base requests and three
adapters mixed in one batch (two slots, so slots are rewritten): with each MoE compute
path (grouped, dense-masked) forced; with some layers dense MLPs (mlp_only_layers, or
decoder_sparse_step 2); with the top-k weights renormalised (norm_topk_prob) and not;
from both checkpoint namings; Qwen2-MoE with its gated shared expert. Sliding windows
apply to the layers transformers slides. An adapter on a dense MLP layer reaches the
engine and is refused there."""

from __future__ import annotations

import json

import pytest

from lora_core.errors import AdapterIncompatible
from replica.models.mlp import MLP
from replica.models.moe import SparseMoE
from replica.offline import adapter_ref
from replica.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, hf_greedy_batch
from tests.tiny import make_tiny_qwen_moe, mixed_requests, run_requests, with_mlp_lora
from tests.unit.replica.engines import small_engine

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)  # stops at EOS, as HF does
PROMPTS = ["hello world how are you", "the quick brown fox jumps over", "what is lorafleet"]


@pytest.fixture(scope="module")
def models(qwen3_moe_dir, qwen2_moe_dir, tiny_dir) -> dict:
    """{name: (model dir, adapter fixture, which layers are MoE blocks)}; the variants
    share their fixture model's attention shapes, so its adapters fit them."""
    q3 = make_tiny_qwen_moe(
        tiny_dir / "qwen3-moe-norm", "qwen3_moe", seed=13, experts=8, top_k=3, fused=True,
        num_hidden_layers=3, decoder_sparse_step=2, norm_topk_prob=True, head_dim=24,
    )  # fmt: skip
    q2 = make_tiny_qwen_moe(
        tiny_dir / "qwen2-moe-norm", "qwen2_moe", seed=14, experts=8, top_k=2, fused=True,
        num_hidden_layers=3, decoder_sparse_step=2, norm_topk_prob=True,
    )  # fmt: skip
    return {
        "q3": (qwen3_moe_dir, "qwen3_moe", [True, False, True]),
        "q3-norm-step2-fused": (q3, "qwen3_moe", [False, True, False]),
        "q2": (qwen2_moe_dir, "qwen2_moe", [True, True, False]),
        "q2-norm-step2-fused": (q2, "qwen2_moe", [False, True, False]),
    }


@pytest.fixture(scope="module")
def references() -> dict:
    """{model: HF's tokens}, filled by the first test of each model."""
    return {}


@pytest.mark.parametrize("compute", ["grouped", "dense"])
@pytest.mark.parametrize("model", ["q3", "q3-norm-step2-fused", "q2", "q2-norm-step2-fused"])
def test_mixed_batch_equals_hf(models, references, request, model, compute):
    model_dir, family, sparse = models[model]
    adapters = request.getfixturevalue(f"{family}_adapters")
    engine = small_engine(model_dir)
    layers = engine.runner.model.model.layers
    assert [isinstance(layer.mlp, SparseMoE) for layer in layers] == sparse
    assert all(isinstance(layer.mlp, SparseMoE | MLP) for layer in layers)
    for layer in layers:
        layer.mlp.compute = compute
    refs = {n: adapter_ref(n, p, max_rank=16) for n, p in adapters.items()}
    got = run_requests(engine, mixed_requests(PROMPTS, GREEDY, refs))
    assert engine.stats().adapter_loads > 2  # three adapters through two slots
    if model not in references:
        references[model] = hf_greedy_batch(model_dir, adapters, engine.tokenizer, PROMPTS, MAX_NEW)
    assert got == references[model]


def test_engine_refuses_an_adapter_on_the_mlps(qwen3_moe_dir, qwen3_moe_adapters, tmp_path):
    """Validated without the base (adapter_ref, as the registry may), an adapter with
    LoRA on dense MLP projections (what a same-sized Qwen3's would be; layer 1 has them:
    mlp_only_layers) reaches the engine, which refuses it against its Qwen3-MoE, naming
    what takes no LoRA, and serves the next request as before."""
    path = with_mlp_lora(qwen3_moe_adapters["qv8"], tmp_path / "mlp", 3, 64, 128)
    engine = small_engine(qwen3_moe_dir)
    good = adapter_ref("good", qwen3_moe_adapters["qv8"], max_rank=16)
    before = run_requests(engine, [("a", PROMPTS[0], GREEDY, good)])
    with pytest.raises(AdapterIncompatible) as e:
        engine.add_request("bad", [5, 6, 7], GREEDY, adapter_ref("mlp", path, max_rank=16))
    assert str(e.value) == (
        "target_modules: matches 'model.layers.0.mlp.gate_proj': Qwen3MoeForCausalLM is a "
        "mixture-of-experts model whose router, experts and dense MLP layers take no LoRA; "
        "allowed: q_proj, k_proj, v_proj, o_proj (attention)"
    )
    assert run_requests(engine, [("b", PROMPTS[0], GREEDY, good)]) == {"b": before["a"]}


# Qwen3-MoE slides every layer; Qwen2-MoE, without layer_types, the even layers below
# max_window_layers (layer 0 here: layer 2 is past max_window_layers 2), or those its
# layer_types names.
@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 6}),
        ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 2}),
        ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 6,
                       "layer_types": ["full_attention", "sliding_attention", "full_attention"]}),
    ],
)  # fmt: skip
def test_sliding_window_equals_hf(tmp_path, arch, extra):
    model_dir = make_tiny_qwen_moe(tmp_path / "m", arch, seed=15, num_hidden_layers=3)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.pop("layer_types", None)
    cfg.update(extra)
    (model_dir / "config.json").write_text(json.dumps(cfg))
    ids = list(range(100, 130))
    engine = small_engine(model_dir)
    assert any(engine.runner.model.config.layer_windows)
    engine.add_request("r", ids, GREEDY, None)
    got = []
    while engine.has_unfinished():
        got += [t for o in engine.step() for t in o.new_token_ids]
    assert got == hf_greedy(model_dir, None, ids, max_new_tokens=MAX_NEW)
