"""RMSNorm and rotary position embeddings (HF Llama conventions, float32 math)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from replica.models.rope_config import RopeScaling


class RMSNorm(nn.Module):
    """y = w * x / rms(x), computed in float32 like HF Llama. x: [T, H]."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """float32 [head_dim / 2]: the rotary inverse frequencies, op for op as transformers
    5 computes them (`modeling_rope_utils`), so float32 outputs match it exactly.

    Semantics (d = head_dim, i = 0 .. d/2-1, f = factor):
        plain:  inv[i] = 1 / theta^(2i/d)
        linear: inv[i] / f                         (positions / f)
        llama3: / f below the low band, kept above the high one, smoothed between
        yarn:   interp = 1 / (f theta^(2i/d)); r = ramp over dims [low, high] (from the
                rotations beta_fast / beta_slow make over the original context);
                inv = interp r + inv (1 - r)
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if scaling is not None and scaling.rope_type == "yarn":
        return _yarn_inv_freq(theta**exponents, head_dim, theta, scaling)
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_len = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(
    pos_freqs: torch.Tensor, dim: int, theta: float, scaling: RopeScaling
) -> torch.Tensor:
    """pos_freqs: float32 [dim / 2], theta^(2i/dim)."""
    original = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength makes `rotations` turns over the original context
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    interpolated = 1.0 / (scaling.factor * pos_freqs)
    return interpolated * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class RotaryEmbedding(nn.Module):
    """Non-interleaved RoPE (rotate_half). Applies to q: [T, heads, d], k: [T, kv_heads, d];
    cos and sin are multiplied by the scaling's attention_factor (yarn's) in float32.

    The model computes the step's table once (`table`, as transformers' model-level
    rotary_emb does) and every layer applies it (`apply_rope`): the table is the same for
    all layers, and computing it per layer cost seven small kernels a layer."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None):
        super().__init__()
        # A plain attribute, not a buffer: model.to(bf16) must not round the frequencies.
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.attention_factor = scaling.attention_factor if scaling is not None else 1.0

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTable:
        """(cos, signed sin) of positions: long [T], each [T, 1, head_dim] in dtype; the
        signed sin is [-sin, sin] over the two halves (`apply_rope`)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        half = sin.shape[-1] // 2
        # rotate_half(x) * sin == roll(x, half) * [-sin_1, sin_2]: the sign moves into the
        # table (negation is exact), so applying it needs no neg and no cat per tensor
        signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return cos.to(dtype)[:, None, :], signed.to(dtype)[:, None, :]


RopeTable = tuple[torch.Tensor, torch.Tensor]


def apply_rope(table: RopeTable, q: torch.Tensor, k: torch.Tensor):
    """q, k rotated by a `RotaryEmbedding.table` of their positions (and dtype):
    x * cos + rotate_half(x) * sin, with rotate_half(x) * sin as roll(x, d/2) times the
    table's signed sin (the same values, bit for bit)."""
    cos, signed = table
    half = q.shape[-1] // 2
    return q * cos + q.roll(half, -1) * signed, k * cos + k.roll(half, -1) * signed
