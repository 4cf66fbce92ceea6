"""Torch reference of `kernels.fused_moe`: the (token, choice) pairs grouped by expert
and one GEMM pair per expert with tokens, in x's dtype, as transformers' MixtralExperts
computes. Correct on any device; it reads the per-expert counts on the host (one sync)
and runs a data-dependent number of GEMMs, so a CUDA graph cannot capture it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """x: [T, H]; w13: [E_local, 2I, H]; w2: [E_local, H, I]; topk_ids: int [T, k];
    topk_weights: float32 [T, k] -> [T, H] in x's dtype (see kernels.fused_moe)."""
    num_local, k = w13.shape[0], topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    mine = ((flat >= 0) & (flat < num_local)).nonzero().squeeze(1)
    order = mine[torch.argsort(flat[mine], stable=True)]  # (token, choice) pairs by expert
    counts = torch.bincount(flat[order], minlength=num_local).tolist()
    tokens = order // k
    xs, ws = x[tokens], topk_weights.reshape(-1)[order]
    out = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = slice(start, start + n)
            gate, up = F.linear(xs[rows], w13[e]).chunk(2, dim=-1)
            down = F.linear(F.silu(gate) * up, w2[e])
            out[rows] = (down.float() * ws[rows, None]).to(x.dtype)
        start += n
    return torch.zeros_like(x).index_add_(0, tokens, out)
