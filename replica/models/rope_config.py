"""A Llama-family config.json's RoPE (theta and frequency scaling), read as transformers
5 reads it, validated once. Torch-free: the ingress reads the context length from it.

Both spellings: transformers < 5 writes `rope_theta` + `rope_scaling`; transformers >= 5
one `rope_parameters` dict holding rope_theta, rope_type and the scaling fields (a Llama
3.1 checkpoint saved by it has no `rope_scaling` at all, so reading only that key ran
such a model with unscaled frequencies). As in transformers, a `rope_scaling` dict wins
over `rope_parameters`, and the chosen dict's rope_theta over a top-level one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lora_core.errors import ModelLoadFailed

SCALED_TYPES = ("linear", "llama3", "yarn")
ALLOWED_TYPES = "none, 'default', 'linear', 'llama3' or 'yarn'"
# rope_theta of a config.json that names none: its config class's default_theta, 10000
# but for Mixtral's (1e6, as every Mixtral checkpoint has it).
_DEFAULT_THETA = {"MixtralForCausalLM": 1e6}


@dataclass(frozen=True)
class RopeScaling:
    """How the RoPE inverse frequencies are scaled (the frequency math:
    `replica.layers.norm_rope.rope_inv_freq`).

    rope_type: "linear" (every frequency / factor, i.e. positions / factor), "llama3"
    (Llama 3.1: low frequencies / factor, a smooth band between) or "yarn" (YaRN:
    frequencies ramped between interpolated and extrapolated, cos and sin x
    attention_factor). factor: the context stretch. original_max_position_embeddings:
    llama3 / yarn: the pretraining context (0 for linear). low_freq_factor /
    high_freq_factor: llama3's band, in wavelengths original/low .. original/high.
    beta_fast / beta_slow: yarn's ramp bounds, in rotations over the original context.
    truncate: yarn's ramp bounds floored / ceiled to whole dimensions. attention_factor:
    what cos and sin are multiplied by (1.0 but for yarn).
    """

    rope_type: str
    factor: float
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    def context_length(self, max_position_embeddings: int) -> int:
        """The context the model serves, by vLLM's rule (`_get_and_verify_max_len`): linear
        stretches max_position_embeddings by factor (a Vicuna-16k names 4096 x 4), yarn
        covers original x factor positions (Qwen 2.5 / 3 turn yarn on in config.json without
        raising max_position_embeddings; unlike vLLM, never less than
        max_position_embeddings), and llama3 leaves max_position_embeddings as it is (a
        Llama 3.1 config.json names its stretched 131072 already)."""
        if self.rope_type == "linear":
            return int(max_position_embeddings * self.factor)
        if self.rope_type == "yarn":
            return max(
                max_position_embeddings, int(self.original_max_position_embeddings * self.factor)
            )
        return max_position_embeddings


def read_rope(cfg: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling or None for plain RoPE) of a config.json; refuses a scaling the
    engine cannot compute as transformers does, naming the field and what is allowed."""
    params = cfg.get("rope_parameters") or {}
    where = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = cfg.get("rope_scaling") or params
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise ModelLoadFailed(
            f"{where}={rope!r}; allowed: one dict of rope_theta, rope_type and its scaling "
            "fields (per-layer-type RoPE is not supported)"
        )
    theta = rope.get("rope_theta")
    if theta is None:
        arch = (cfg.get("architectures") or [""])[0]
        where_theta, theta = "config.json", cfg.get("rope_theta", _DEFAULT_THETA.get(arch, 1e4))
    else:
        where_theta = where
    theta = _number(where_theta, "rope_theta", theta, "a number > 0", lambda v: v > 0)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return theta, None
    if kind == "dynamic":
        raise ModelLoadFailed(
            f"{where} rope_type 'dynamic' (dynamic NTK): transformers recomputes its "
            "frequencies from each forward's sequence length, which a batched engine with a "
            f"prefix cache cannot reproduce per sequence; allowed: {ALLOWED_TYPES}"
        )
    if kind not in SCALED_TYPES:
        raise ModelLoadFailed(f"{where} rope_type {kind!r}; allowed: {ALLOWED_TYPES}")
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        raise ModelLoadFailed(
            f"{where} partial_rotary_factor={partial!r} with rope_type {kind!r}; allowed: 1.0 "
            "(the whole head rotated)"
        )
    if kind == "linear":
        return theta, RopeScaling("linear", _factor(where, rope))
    original = _original_max_positions(where, rope, cfg)
    if kind == "llama3":
        return theta, _llama3(where, rope, original)
    return theta, _yarn(where, rope, cfg, original)


def _llama3(where: str, rope: dict, original: int) -> RopeScaling:
    for name in ("low_freq_factor", "high_freq_factor"):
        if name not in rope:
            raise ModelLoadFailed(f"{where} {name} missing; allowed: a number > 0 (llama3)")
    positive = ("a number > 0", lambda v: v > 0)
    low = _number(where, "low_freq_factor", rope["low_freq_factor"], *positive)
    high = _number(where, "high_freq_factor", rope["high_freq_factor"], *positive)
    if high <= low:
        raise ModelLoadFailed(
            f"{where} high_freq_factor={high!r}, low_freq_factor={low!r}; allowed: "
            "high_freq_factor > low_freq_factor"
        )
    return RopeScaling("llama3", _factor(where, rope), original, low, high)


def _yarn(where: str, rope: dict, cfg: dict, original: int) -> RopeScaling:
    """transformers' `_compute_yarn_parameters`: a null factor is max_position_embeddings
    / original; beta_fast / beta_slow of 0 or null fall back to 32 / 1; attention_factor,
    when not given, is 0.1 ln(factor) + 1 (1 for factor <= 1), or with mscale and
    mscale_all_dim both set (DeepSeek's) the ratio of that formula scaled by each."""
    if "factor" not in rope:
        raise ModelLoadFailed(f"{where} factor missing; allowed: a number > 0 (yarn)")
    if rope["factor"] is None:
        factor = _max_positions(where, cfg, "factor: null") / original
    else:
        factor = _factor(where, rope)
    betas = {}
    for name, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        value = rope.get(name) or default
        betas[name] = _number(where, name, value, "a number > 0", lambda v: v > 0)
    mscales = [
        _number(where, name, rope.get(name) or 0.0, "a number >= 0", lambda v: v >= 0)
        for name in ("mscale", "mscale_all_dim")
    ]
    attention = rope.get("attention_factor")
    if attention is None:
        if all(mscales):
            attention = _mscale(factor, mscales[0]) / _mscale(factor, mscales[1])
        else:
            attention = _mscale(factor, 1.0)
    attention = _number(where, "attention_factor", attention, "a number > 0", lambda v: v > 0)
    truncate = rope.get("truncate", True)
    if truncate is not None and not isinstance(truncate, bool):
        raise ModelLoadFailed(f"{where} truncate={truncate!r}; allowed: true or false")
    return RopeScaling(
        "yarn",
        factor,
        original,
        beta_fast=betas["beta_fast"],
        beta_slow=betas["beta_slow"],
        truncate=bool(truncate),
        attention_factor=attention,
    )


def _mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _factor(where: str, rope: dict) -> float:
    if "factor" not in rope:
        raise ModelLoadFailed(f"{where} factor missing; allowed: a number > 0")
    return _number(where, "factor", rope["factor"], "a number > 0", lambda v: v > 0)


def _original_max_positions(where: str, rope: dict, cfg: dict) -> int:
    """transformers 5 takes a top-level original_max_position_embeddings over the scaling
    dict's (Phi-3's layout), and falls back to max_position_embeddings."""
    if "original_max_position_embeddings" in cfg:
        where, value = "config.json", cfg["original_max_position_embeddings"]
    elif "original_max_position_embeddings" in rope:
        value = rope["original_max_position_embeddings"]
    else:
        value = _max_positions(where, cfg, "original_max_position_embeddings missing")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelLoadFailed(
            f"{where} original_max_position_embeddings={value!r}; allowed: an integer > 0"
        )
    return value


def _max_positions(where: str, cfg: dict, why: str) -> int:
    value = cfg.get("max_position_embeddings")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelLoadFailed(
            f"{where} {why} and max_position_embeddings={value!r}; allowed: "
            "original_max_position_embeddings (or max_position_embeddings) an integer > 0"
        )
    return value


def _number(where: str, name: str, value, allowed: str, ok) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelLoadFailed(f"{where} {name}={value!r}; allowed: {allowed}")
    if not math.isfinite(value) or not ok(value):
        raise ModelLoadFailed(f"{where} {name}={value!r}; allowed: {allowed}")
    return float(value)
