"""Torch reference for kernels.paged_attention (the contract is in kernels/__init__.py).

One sequence at a time: its keys and values gathered from the cache by its block
table, grouped query heads expanded, a masked softmax. Plain and slow; the oracle of
the Triton kernel (run on float64 copies) and the CPU backend of kernels.paged_attention.
The engine's own CPU path (replica/layers/attention.py) batches the decode queries and
keeps the step's masks, and is tested against HF + PEFT.
"""

from __future__ import annotations

import torch


def query_layout(context_lens, query_lens) -> list[tuple[int, int, int]]:
    """[(first query row, query count, context length)] per sequence: decode (query_lens
    None) puts sequence i's one query in row i; else the sequences' queries follow one
    another in q's rows."""
    ctx = [int(c) for c in context_lens]
    if query_lens is None:
        return [(i, 1, c) for i, c in enumerate(ctx)]
    rows, start = [], 0
    for n, c in zip(query_lens, ctx, strict=True):
        rows.append((start, int(n), c))
        start += int(n)
    return rows


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens,
    *,
    scale: float,
    window: int | None = None,
    query_lens=None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """kernels.paged_attention in torch ops, in q's dtype (float32 math for half inputs)."""
    _, bs, kvh, _ = k_cache.shape
    group = q.shape[1] // kvh
    out = torch.empty_like(q) if out is None else out
    math = torch.float64 if q.dtype == torch.float64 else torch.float32
    for i, (row, n, ctx) in enumerate(query_layout(context_lens, query_lens)):
        if n == 0:
            continue
        table = block_tables[i, : -(-ctx // bs)].long()
        keys = k_cache[table].flatten(0, 1)[:ctx].to(math)  # [ctx, kvh, d]
        vals = v_cache[table].flatten(0, 1)[:ctx].to(math)
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, d]
        vals = vals.repeat_interleave(group, dim=1).transpose(0, 1)
        qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        kpos = torch.arange(ctx, device=q.device)[None, :]
        visible = kpos <= qpos
        if window is not None:
            visible &= kpos > qpos - window
        qs = q[row : row + n].to(math).transpose(0, 1)  # [heads, n, d]
        scores = (qs @ keys.transpose(1, 2)) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        o = torch.softmax(scores, dim=-1) @ vals  # [heads, n, d]
        out[row : row + n] = o.transpose(0, 1).to(out.dtype)
    return out
