"""Paged attention's masks are made once per step and sliding window, then reused by every
layer: the same outputs as masks made afresh, and against a dense float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from replica.layers.attention import AttentionMetadata, PrefillChunk, paged_attention

BS, KVH, HEADS, D = 4, 2, 4, 8


def _step(g):
    """Two decode sequences (contexts 7 and 10) and one prompt chunk of 5 tokens after 6
    cached ones, in a 12-block cache; -> (meta, k_cache, v_cache, the token positions)."""
    k_cache = torch.randn(12, BS, KVH, D, generator=g, dtype=torch.float64)
    v_cache = torch.randn(12, BS, KVH, D, generator=g, dtype=torch.float64)
    tables = torch.tensor([[0, 1, 0], [2, 3, 4]])
    chunk = PrefillChunk(2, 5, 11, torch.tensor([5, 6, 7]))
    positions = [6, 9, *range(6, 11)]
    block_of = [tables[0], tables[1]] + [chunk.block_table] * 5
    slots = torch.tensor(
        [int(t[p // BS]) * BS + p % BS for t, p in zip(block_of, positions, strict=True)]
    )
    meta = AttentionMetadata(slots, 2, tables, torch.tensor([7, 10]), [chunk])
    return meta, k_cache, v_cache, positions, block_of


def _reference(q, k_cache, v_cache, positions, block_of, window):
    out = torch.empty_like(q)
    for i, (pos, table) in enumerate(zip(positions, block_of, strict=True)):
        keys = torch.stack([k_cache[table[p // BS], p % BS] for p in range(pos + 1)])
        vals = torch.stack([v_cache[table[p // BS], p % BS] for p in range(pos + 1)])
        seen = [p for p in range(pos + 1) if window is None or p > pos - window]
        for h in range(HEADS):
            kv = h // (HEADS // KVH)
            s = torch.stack([q[i, h] @ keys[p, kv] for p in seen]) / math.sqrt(D)
            out[i, h] = torch.softmax(s, 0) @ vals[seen, kv]
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_masks_are_made_once_per_step_and_window(window):
    g = torch.Generator().manual_seed(7)
    meta, k_cache, v_cache, positions, block_of = _step(g)
    q = torch.randn(7, HEADS, D, generator=g, dtype=torch.float64)
    k = torch.randn(7, KVH, D, generator=g, dtype=torch.float64)
    v = torch.randn(7, KVH, D, generator=g, dtype=torch.float64)
    first = paged_attention(q, k, v, k_cache, v_cache, meta, D**-0.5, window)
    made = dict(meta.step_cache)
    assert set(made) == {("decode", window), ("prefill", 0, window)}
    again = paged_attention(q, k, v, k_cache, v_cache, meta, D**-0.5, window)  # a second layer
    assert all(meta.step_cache[key] is m for key, m in made.items())  # reused, not remade
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    fresh, *_ = _step(torch.Generator().manual_seed(7))
    torch.testing.assert_close(
        paged_attention(q, k, v, k_cache, v_cache, fresh, D**-0.5, window), first, rtol=0, atol=0
    )
    want = _reference(q, k_cache, v_cache, positions, block_of, window)
    torch.testing.assert_close(first, want, rtol=1e-10, atol=1e-10)
    other = 2 if window is None else None  # another layer's window gets its own masks
    paged_attention(q, k, v, k_cache, v_cache, meta, D**-0.5, other)
    assert ("decode", other) in meta.step_cache and len(meta.step_cache) == 4
