"""RMSNorm and rotary position embeddings (HF Llama conventions, float32 math)."""

from __future__ import annotations

import math

import torch
from torch import nn


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


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Non-interleaved RoPE (rotate_half). Applies to q: [T, heads, d], k: [T, kv_heads, d]."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        if scaling is not None:
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        # A plain attribute, not a buffer: model.to(bf16) must not round the frequencies.
        self.inv_freq = inv_freq

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(q.dtype)[:, None, :]
        sin = emb.sin().to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
