"""RoPE scaling read from config.json (replica.models.rope_config) and its frequencies
(replica.layers.norm_rope): for linear, llama3 and yarn in both spellings (transformers
< 5's rope_theta + rope_scaling, >= 5's rope_parameters) and the fallbacks transformers
takes, the inverse frequencies, attention factor and rotated q / k equal those of
transformers' own rotary embedding, bit for bit; the context length linear and yarn
cover (vLLM's rule); and clear refusals of what the engine cannot compute as
transformers does."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers

from lora_core.errors import ModelLoadFailed
from replica.layers.norm_rope import RotaryEmbedding, apply_rope
from replica.models.config import ModelConfig, max_positions
from replica.models.rope_config import read_rope

ARCHS = {
    "llama": ("LlamaForCausalLM", {}),
    "mistral": ("MistralForCausalLM", {}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 24}),
}
BASE = {
    "vocab_size": 64,
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 32,
    "max_position_embeddings": 128,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

# (config.json fields beyond BASE); each is written in both spellings unless it names one
CASES = {
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.5}},
    "linear_type_key": {"rope_scaling": {"type": "linear", "factor": 3}},
    "llama3": {"rope_scaling": LLAMA3},
    "yarn": {"rope_scaling": YARN},
    "yarn_theta": {"rope_theta": 5e5, "rope_scaling": {**YARN, "factor": 8}},
    # ramp bounds between whole dimensions (1.66 .. 3.82 for head_dim 16), kept or rounded
    "yarn_betas_untruncated": {
        "rope_scaling": {
            **YARN,
            "original_max_position_embeddings": 1024,
            "beta_fast": 24,
            "beta_slow": 2.0,
            "truncate": False,
        }
    },
    "yarn_betas_truncated": {
        "rope_scaling": {**YARN, "original_max_position_embeddings": 1024, "beta_fast": 24}
    },
    # both ramp bounds clamp to dimension 0: transformers widens the ramp by 0.001
    "yarn_tiny_original": {"rope_scaling": {**YARN, "original_max_position_embeddings": 4}},
    "yarn_zero_betas": {"rope_scaling": {**YARN, "beta_fast": 0, "beta_slow": None}},
    "yarn_mscale": {"rope_scaling": {**YARN, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.7}},
    "yarn_lone_mscale": {"rope_scaling": {**YARN, "mscale": 0.7}},
    "yarn_attention_factor": {"rope_scaling": {**YARN, "attention_factor": 1.5}},
    "yarn_null_factor": {"rope_scaling": {**YARN, "factor": None}},  # max_positions / original
    "yarn_factor_below_one": {"rope_scaling": {**YARN, "factor": 0.5}},
    "yarn_no_original": {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
    # transformers 5 takes a top-level original_max_position_embeddings over the dict's
    "yarn_top_original": {"original_max_position_embeddings": 24, "rope_scaling": YARN},
    "llama3_top_original": {"original_max_position_embeddings": 24, "rope_scaling": LLAMA3},
}
# spelling-specific cases: where rope_theta comes from, which dict wins
SPELLED = {
    # rope_parameters' rope_theta wins over a top-level one
    "dict_theta_wins": {"rope_theta": 5e5, "rope_parameters": {**YARN, "rope_theta": 2e4}},
    # rope_scaling wins over rope_parameters, whose rope_theta is then not read either
    "rope_scaling_wins": {
        "rope_scaling": YARN,
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 3e4},
    },
}


def _spelled(extra: dict, spelling: str) -> dict:
    """extra as transformers < 5 (rope_theta + rope_scaling) or >= 5 (rope_parameters)."""
    extra = dict(extra)
    if spelling == "rope_parameters" and "rope_scaling" in extra:
        params = extra.pop("rope_scaling")
        theta = extra.pop("rope_theta", None)
        extra["rope_parameters"] = {**params, **({"rope_theta": theta} if theta else {})}
    return extra


def _hf_rotary(tmp_path, cfg: dict):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = transformers.AutoConfig.from_pretrained(str(tmp_path))
    return transformers.AutoModelForCausalLM.from_config(config).model.rotary_emb


def _rotate(rotary, positions, q, k):
    cos, sin = rotary(q, positions[None])
    cos, sin = cos[0, :, None, :], sin[0, :, None, :]
    half = q.shape[-1] // 2

    def turn(x):
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    return turn(q), turn(k)


def _check_against_hf(tmp_path, arch: str, extra: dict) -> None:
    name, shape = ARCHS[arch]
    cfg = {**BASE, "architectures": [name], "model_type": arch, **shape, **extra}
    hf = _hf_rotary(tmp_path, cfg)
    model = ModelConfig.from_hf(cfg)
    ours = RotaryEmbedding(model.head_dim, model.rope_theta, model.rope_scaling)
    assert torch.equal(ours.inv_freq, hf.inv_freq)
    assert ours.attention_factor == hf.attention_scaling
    g = torch.Generator().manual_seed(0)
    positions = torch.arange(200)  # well past every original_max_position_embeddings
    q = torch.randn(200, 4, model.head_dim, generator=g)
    k = torch.randn(200, 2, model.head_dim, generator=g)
    want = _rotate(hf, positions, q, k)
    got = apply_rope(ours.table(positions, q.dtype), q, k)  # as DecoderModel applies it
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("case", CASES)
def test_scaled_rope_equals_transformers(tmp_path, arch, spelling, case):
    _check_against_hf(tmp_path, arch, _spelled(CASES[case], spelling))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", SPELLED)
def test_rope_theta_and_dict_precedence_equal_transformers(tmp_path, arch, case):
    _check_against_hf(tmp_path, arch, SPELLED[case])


@pytest.mark.parametrize(
    ("extra", "length"),
    [
        ({}, 128),
        ({"rope_scaling": {**LLAMA3, "factor": 32.0}}, 128),
        # vLLM's rule: linear stretches max_position_embeddings by factor, llama3 does not
        ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, 512),
        ({"rope_parameters": {"type": "linear", "factor": 2.5}}, 320),
        ({"rope_scaling": {**YARN, "factor": 4.0}}, 128),  # 16 x 4 < max_position_embeddings
        # Qwen 2.5 / 3 turn yarn on without raising max_position_embeddings
        ({"rope_scaling": {**YARN, "original_max_position_embeddings": 64}}, 256),
        ({"rope_parameters": {**YARN, "original_max_position_embeddings": 64}}, 256),
        ({"rope_scaling": {**YARN, "factor": None, "original_max_position_embeddings": 32}}, 128),
    ],
)  # fmt: skip
def test_context_length(extra, length):
    cfg = {**BASE, "architectures": ["Qwen2ForCausalLM"], **extra}
    assert max_positions(cfg) == ModelConfig.from_hf(cfg).max_position_embeddings == length


def test_a_context_of_no_positions_is_refused_at_load():
    """A linear factor that stretches the context below one position (128 x 0.001) fails
    the load, rather than a model that refuses every request."""
    cfg = {**BASE, "architectures": ["LlamaForCausalLM"]}
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 0.001}
    message = "max_position_embeddings=128 x RoPE factor 0.001 leaves a context of 0 positions"
    with pytest.raises(ModelLoadFailed, match=re.escape(message)):
        max_positions(cfg)
    with pytest.raises(ModelLoadFailed, match=re.escape(message)):
        ModelConfig.from_hf(cfg)


R = "rope_scaling"
REFUSALS = [
    ({R: {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic' (dynamic NTK)"),
    ({R: {"rope_type": "longrope", "factor": 2.0}}, "rope_type 'longrope'; allowed: none, "
     "'default', 'linear', 'llama3' or 'yarn'"),
    ({"rope_parameters": {"rope_type": "su"}}, "rope_parameters rope_type 'su'; allowed: none"),
    ({R: {"rope_type": "linear"}}, "rope_scaling factor missing; allowed: a number > 0"),
    ({R: {"rope_type": "linear", "factor": 0}}, "factor=0; allowed: a number > 0"),
    ({R: {"rope_type": "linear", "factor": "4"}}, "factor='4'; allowed: a number > 0"),
    ({R: {**YARN, "factor": -2.0}}, "rope_scaling factor=-2.0; allowed: a number > 0"),
    ({R: {"rope_type": "yarn", "original_max_position_embeddings": 16}}, "factor missing"),
    ({R: {**YARN, "original_max_position_embeddings": 0}},
     "rope_scaling original_max_position_embeddings=0; allowed: an integer > 0"),
    ({"original_max_position_embeddings": "16", R: YARN},
     "config.json original_max_position_embeddings='16'; allowed: an integer > 0"),
    ({R: {**YARN, "beta_fast": -1}}, "beta_fast=-1; allowed: a number > 0"),
    ({R: {**YARN, "attention_factor": 0.0}}, "attention_factor=0.0; allowed: a number > 0"),
    ({R: {**YARN, "mscale": -1.0}}, "mscale=-1.0; allowed: a number >= 0"),
    ({R: {**YARN, "truncate": "yes"}}, "truncate='yes'; allowed: true or false"),
    ({R: {**YARN, "partial_rotary_factor": 0.5}}, "partial_rotary_factor=0.5 with rope_type "
     "'yarn'; allowed: 1.0"),
    ({"partial_rotary_factor": 0.5, R: LLAMA3}, "partial_rotary_factor=0.5"),
    ({R: {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}},
     "rope_scaling low_freq_factor missing; allowed: a number > 0 (llama3)"),
    ({R: {**LLAMA3, "high_freq_factor": 1.0}}, "allowed: high_freq_factor > low_freq_factor"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}},
     "per-layer-type RoPE is not supported"),
    ({"rope_theta": 0}, "config.json rope_theta=0; allowed: a number > 0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}},
     "rope_parameters rope_theta=-1.0; allowed: a number > 0"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "message"), REFUSALS)
def test_what_the_engine_cannot_compute_is_refused(extra, message):
    cfg = {**BASE, "architectures": ["LlamaForCausalLM"], **extra}
    with pytest.raises(ModelLoadFailed, match=re.escape(message)):
        read_rope(cfg)
    with pytest.raises(ModelLoadFailed):
        ModelConfig.from_hf(cfg)


def test_plain_rope_has_no_scaling():
    for extra in ({}, {"rope_scaling": None}, {"rope_parameters": {"rope_type": "default"}}):
        assert read_rope({**BASE, **extra}) == (10000.0, None)
    assert read_rope({"rope_theta": 5e5}) == (5e5, None)


@pytest.mark.parametrize(
    ("name", "model_type"),
    [
        ("LlamaForCausalLM", "llama"),
        ("MistralForCausalLM", "mistral"),
        ("Qwen2ForCausalLM", "qwen2"),
        ("Qwen3ForCausalLM", "qwen3"),
        ("MixtralForCausalLM", "mixtral"),
        ("Qwen2MoeForCausalLM", "qwen2_moe"),
        ("Qwen3MoeForCausalLM", "qwen3_moe"),
    ],
)
@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0}])
def test_a_config_without_rope_theta_takes_its_class_default(tmp_path, name, model_type, scaling):
    """No rope_theta anywhere: transformers takes the config class's default_theta (a
    Mixtral's 1e6, not 10000)."""
    cfg = {**BASE, "architectures": [name], "model_type": model_type}
    if scaling:
        cfg["rope_scaling"] = scaling
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert read_rope(cfg)[0] == hf.rope_parameters["rope_theta"]
