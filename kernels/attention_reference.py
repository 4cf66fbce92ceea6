"""Torch reference for kernels.paged_attention (the contract is in kernels/__init__.py).

One sequence at a time: its keys and values gathered from the cache by its block
table, grouped query heads expanded, SDPA under the causal mask. Plain and slow; the
oracle of the Triton kernel (run on float64 copies) and the CPU backend of
kernels.paged_attention. The engine's own CPU path (replica/layers/attention.py) runs
its prompt chunks through `attend_sequence` with the step's masks kept, batches its
decode queries, and is tested against HF + PEFT.
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


def visible_keys(q_len: int, context_len: int, window: int | None, device) -> torch.Tensor:
    """bool [q_len, context_len]: which keys each of a sequence's last q_len queries sees
    (causal, within the sliding window where there is one)."""
    qpos = torch.arange(context_len - q_len, context_len, device=device)[:, None]
    kpos = torch.arange(context_len, device=device)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    return mask


def attend_sequence(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
    window: int | None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence's last n queries q [n, heads, d] over its context_len keys -> [n, heads,
    d], in q's dtype: its keys and values gathered by its block table, each KV head
    repeated for its query heads, SDPA under `visible_keys` (mask, where the caller keeps
    it for a step's layers). The engine's CPU prompt chunks run this too
    (replica/layers/attention.py)."""
    group = q.shape[1] // k_cache.shape[2]
    keys = k_cache[block_table].flatten(0, 1)[:context_len]  # [ctx, kvh, d]
    vals = v_cache[block_table].flatten(0, 1)[:context_len]
    keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, d]
    vals = vals.repeat_interleave(group, dim=1).transpose(0, 1)
    if mask is None:
        mask = visible_keys(q.shape[0], context_len, window, q.device)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), keys, vals, attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


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
    """kernels.paged_attention in torch ops, in q's dtype: `attend_sequence` per sequence."""
    out = torch.empty_like(q) if out is None else out
    for i, (row, n, ctx) in enumerate(query_layout(context_lens, query_lens)):
        if n:
            s = slice(row, row + n)
            out[s] = attend_sequence(q[s], k_cache, v_cache, block_tables[i], ctx, scale, window)
    return out
