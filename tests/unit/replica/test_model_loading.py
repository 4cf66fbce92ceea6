"""Model loading: architectures, sharded checkpoints, hub ids from the local HF cache,
and clear failures. Each checks our decoder's logits against transformers'."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from lora_core.errors import InvalidRequest, ModelLoadFailed
from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.sampling_params import SamplingParams
from tests.tiny import make_tiny_model


def _greedy(engine: LLMEngine, ids: list[int], n: int) -> list[int]:
    engine.add_request("r", ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    out = []
    while engine.has_unfinished():
        out += [t for o in engine.step() for t in o.new_token_ids]
    return out


def _hf_greedy(model_dir, ids: list[int], n: int) -> list[int]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32
    ).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()


def _engine(model: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device="cpu", block_size=4, **kw))


def test_mistral_sliding_window_matches_transformers(tmp_path):
    model_dir = make_tiny_model(tmp_path / "mistral", "mistral", seed=4)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["sliding_window"] = 6
    (model_dir / "config.json").write_text(json.dumps(cfg))
    ids = list(range(20, 40))
    assert _greedy(_engine(str(model_dir)), ids, 10) == _hf_greedy(model_dir, ids, 10)


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        # Qwen2 slides only the layers from max_window_layers on: layer 0 attends fully
        ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 6,
                   "layer_types": ["sliding_attention", "full_attention"]}),
        ("qwen2", {"use_sliding_window": False, "sliding_window": 6, "max_window_layers": 0}),
        # Qwen3 follows Qwen2's rules (its head_dim 24 is not hidden/heads)
        ("qwen3", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 6,
                   "layer_types": ["sliding_attention", "full_attention"]}),
        ("qwen3", {"use_sliding_window": False, "sliding_window": 6, "max_window_layers": 0}),
        ("llama", {"sliding_window": 6}),  # transformers' Llama has no sliding window
    ],
)  # fmt: skip
def test_per_layer_sliding_window_matches_transformers(tmp_path, arch, extra):
    build = {"head_dim": 24} if arch == "qwen3" else {}
    model_dir = make_tiny_model(tmp_path / arch, arch, seed=8, **build)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.pop("layer_types", None)
    cfg.update(extra)
    (model_dir / "config.json").write_text(json.dumps(cfg))
    ids = list(range(100, 130))
    assert _greedy(_engine(str(model_dir)), ids, 8) == _hf_argmax(model_dir, ids, 8)


def test_qwen3_attention_bias_matches_transformers(tmp_path):
    """attention_bias: a Qwen3 with biases on q, k, v and o (o's added once under TP)."""
    model_dir = make_tiny_model(
        tmp_path / "qwen3-bias", "qwen3", seed=9, head_dim=24, attention_bias=True
    )
    ids = list(range(40, 70))
    assert _greedy(_engine(str(model_dir)), ids, 8) == _hf_argmax(model_dir, ids, 8)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
def test_llama3_rope_scaling_matches_transformers(tmp_path, spelling):
    """Llama 3.1-style frequency scaling, in the config.json spelling transformers >= 5
    writes (one rope_parameters dict) and the older one (rope_theta + rope_scaling)."""
    model_dir = make_tiny_model(tmp_path / "llama3", "llama", seed=7)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.pop("rope_scaling", None)
    if spelling == "rope_parameters":
        cfg["rope_parameters"] = {"rope_theta": 500000.0, **LLAMA3_ROPE}
    else:
        cfg["rope_theta"], cfg["rope_scaling"] = 500000.0, LLAMA3_ROPE
    (model_dir / "config.json").write_text(json.dumps(cfg))
    ids = list(range(60, 90))
    assert _greedy(_engine(str(model_dir)), ids, 8) == _hf_argmax(model_dir, ids, 8)


def _hf_argmax(model_dir, ids: list[int], n: int) -> list[int]:
    """Greedy continuation by HF argmax (EOS is a token like any other, as with ignore_eos)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    toks = list(ids)
    with torch.no_grad():
        for _ in range(n):
            toks.append(int(hf(input_ids=torch.tensor([toks])).logits[0, -1].argmax()))
    return toks[len(ids) :]


def test_unsupported_rope_type_in_rope_parameters_is_refused(tmp_path, llama_dir):
    model_dir = tmp_path / "longrope"
    shutil.copytree(llama_dir, model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "longrope", "factor": 4.0}
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadFailed, match="'longrope'; allowed: none, 'default', 'linear'"):
        _engine(str(model_dir))


def test_sharded_checkpoint_loads(tmp_path):
    model_dir = tmp_path / "sharded"
    from deploy.demo import build_model, build_tokenizer

    build_tokenizer(model_dir)
    build_model(
        model_dir,
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=128,
        seed=5,
        shard_bytes="60KB",
    )
    assert (model_dir / "model.safetensors.index.json").exists()
    ids = list(range(30, 42))
    assert _greedy(_engine(str(model_dir)), ids, 6) == _hf_greedy(model_dir, ids, 6)


def test_hub_id_resolved_from_local_cache(tmp_path, llama_dir, monkeypatch):
    snap = tmp_path / "hub" / "models--acme--tiny-llama" / "snapshots" / "abc123"
    shutil.copytree(llama_dir, snap)
    (tmp_path / "hub" / "models--acme--tiny-llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny-llama" / "refs" / "main").write_text("abc123")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    ids = list(range(50, 60))
    assert _greedy(_engine("acme/tiny-llama"), ids, 5) == _greedy(_engine(str(llama_dir)), ids, 5)


def test_unreadable_models_fail_clearly(tmp_path, llama_dir):
    with pytest.raises(ModelLoadFailed, match="not in the local HF cache"):
        _engine("nobody/nothing-here")
    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(ModelLoadFailed, match="safetensors"):
        _engine(str(broken))
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(llama_dir, gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (gpt2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadFailed, match="LlamaForCausalLM"):
        _engine(str(gpt2))


def test_max_model_len_past_the_model_is_refused(llama_dir):
    """vLLM refuses a max_model_len over max_position_embeddings; it was clamped silently
    (engine and ingress), so an operator asking for more got less without a word."""
    from router.ingress import model_max_len

    native = json.loads((llama_dir / "config.json").read_text())["max_position_embeddings"]
    for build in (
        lambda n: LLMEngine(EngineConfig(model=str(llama_dir), device="cpu", max_model_len=n)),
        lambda n: model_max_len(str(llama_dir), n),
    ):
        with pytest.raises(InvalidRequest, match=f"max_model_len={native + 1} exceeds .*={native}"):
            build(native + 1)
    assert LLMEngine(EngineConfig(model=str(llama_dir), device="cpu")).max_model_len == native
    assert model_max_len(str(llama_dir), native) == native
    assert model_max_len(str(llama_dir), 0) == native
    assert model_max_len(str(llama_dir), 7) == 7


def test_yarn_serves_its_original_context_times_factor(tmp_path, llama_dir):
    """Qwen 2.5 / 3 turn yarn on in config.json without raising max_position_embeddings:
    the context served is original_max_position_embeddings x factor (vLLM's rule), for the
    engine and the ingress alike; more is refused."""
    from router.ingress import model_max_len

    model_dir = tmp_path / "yarn"
    shutil.copytree(llama_dir, model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["max_position_embeddings"] = 512
    cfg["rope_scaling"] = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
    }
    (model_dir / "config.json").write_text(json.dumps(cfg))
    assert model_max_len(str(model_dir), 0) == 2048
    assert _engine(str(model_dir), kv_cache_tokens=2048).max_model_len == 2048
    with pytest.raises(
        InvalidRequest, match="max_model_len=2049 exceeds the model's context length=2048"
    ):
        _engine(str(model_dir), max_model_len=2049)
