"""Scaled RoPE end to end: for linear and yarn scaling on every architecture that shares
the rotary code (Llama, Mistral, Qwen2, Qwen3), the engine's greedy output equals HF
transformers (+ PEFT) argmax, token for token in float32, for the base model and two
adapters in one batch, with prompt + output running well past the original context
(yarn's original_max_position_embeddings 16; linear's max_position_embeddings, set to
16, which vLLM's rule stretches by factor to the context served) the scaling stretches."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from replica.offline import adapter_ref
from replica.sampling_params import SamplingParams
from tests.hf_reference import hf_model
from tests.tiny import ADAPTER_SPECS, make_peft_adapter, make_tiny_model
from tests.unit.replica.engines import small_engine

ORIGINAL = 16
ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    # DeepSeek's spelling: attention_factor from mscale / mscale_all_dim, untruncated ramp
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": ORIGINAL,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 24,
        "truncate": False,
    },
}
ADAPTERS = ("all16rs", "pattern")
PROMPT = [(7 * i + 11) % 300 + 5 for i in range(28)]  # 28 + 12 tokens: past 2 x ORIGINAL
MAX_NEW = 12


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("mistral") / "model", "mistral", seed=4)


@pytest.fixture(scope="module")
def mistral_adapters(mistral_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mistral-adapters")
    return {
        name: make_peft_adapter(mistral_dir, root / name, seed=30 + i, **ADAPTER_SPECS[name])
        for i, name in enumerate(ADAPTERS)
    }


def _scaled_copy(model_dir: Path, out: Path, rope: dict, spelling: str) -> Path:
    """model_dir's weights under `out`, its config.json scaling RoPE by `rope` in the
    spelling transformers < 5 writes (rope_theta + rope_scaling) or >= 5 writes; a linear
    one's max_position_embeddings ORIGINAL, so the engine serves past it only by factor."""
    shutil.copytree(model_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    params = cfg.pop("rope_parameters", None) or {}
    cfg.pop("rope_scaling", None)
    theta = cfg.pop("rope_theta", None) or params.get("rope_theta", 10000.0)
    if rope["rope_type"] == "linear":
        cfg["max_position_embeddings"] = ORIGINAL
    if spelling == "rope_parameters":
        cfg["rope_parameters"] = {"rope_theta": theta, **rope}
    else:
        cfg["rope_theta"], cfg["rope_scaling"] = theta, rope
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _hf_argmax(model_dir: Path, adapter: Path | None, n: int) -> list[int]:
    """Greedy continuation of PROMPT by HF argmax over full forwards (EOS is a token like
    any other, as with ignore_eos)."""
    model = hf_model(model_dir, adapter)
    tokens = list(PROMPT)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(PROMPT) :]


def _engine_greedy(model_dir: Path, adapters: dict[str, Path]) -> dict[str | None, list[int]]:
    """The base model and every adapter, one request each, run together in one engine."""
    engine = small_engine(model_dir)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    names = [None, *adapters]
    for i, name in enumerate(names):
        ref = adapter_ref(name, adapters[name], max_rank=16) if name else None
        engine.add_request(str(i), PROMPT, params, ref)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(names))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return {name: out[str(i)] for i, name in enumerate(names)}


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize(
    ("rope", "spelling"),
    [("linear", "rope_scaling"), ("yarn", "rope_parameters"), ("yarn_mscale", "rope_scaling")],
)
def test_scaled_rope_generates_what_hf_and_peft_do(arch, rope, spelling, request, tmp_path):
    base = request.getfixturevalue(f"{arch}_dir")
    fixture = request.getfixturevalue(f"{arch}_adapters")
    adapters = {name: fixture[name] for name in ADAPTERS}  # they fit: same shapes
    model_dir = _scaled_copy(base, tmp_path / "model", ROPES[rope], spelling)
    got = _engine_greedy(model_dir, adapters)
    for name in got:
        want = _hf_argmax(model_dir, adapters[name] if name else None, MAX_NEW)
        assert got[name] == want, name
