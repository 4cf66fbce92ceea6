"""On the Triton path, whole long prompts (no cached keys, meta.dense_prompt_min queries or
more, not cut by the sliding window) attend through dense causal SDPA on the step's own
k / v; every other chunk and the decode tokens through the paged kernel (the CPU
interpreter here). Outputs equal the float64 oracle's, whichever way each chunk goes, and
no row is left unwritten (out is poisoned first)."""

from __future__ import annotations

import pytest
import torch

import replica.layers.attention as attn
from kernels.testing import rel_err
from replica.layers.attention import AttentionMetadata, PrefillChunk, paged_attention

BS, KVH, HEADS, D = 4, 2, 8, 16


def _step(g, dtype, least):
    """One decode sequence (context 6), then chunks: a whole 12-token prompt, 5 tokens
    after 7 cached, a whole 3-token prompt, a whole 9-token prompt. -> (meta, q, k, v,
    caches, (positions, block table) per row)."""
    layout = [(12, 12), (5, 12), (3, 3), (9, 9)]  # (queries, context) per chunk
    blocks = torch.randperm(40, generator=g)
    tables, used = [], 0
    for need in [6] + [ctx for _, ctx in layout]:
        n = -(-need // BS)
        tables.append(blocks[used : used + n])
        used += n
    rows = [(5, tables[0])]
    chunks, start = [], 1
    for (n, ctx), table in zip(layout, tables[1:], strict=True):
        chunks.append(PrefillChunk(start, n, ctx, table))
        rows += [(p, table) for p in range(ctx - n, ctx)]
        start += n
    slots = torch.tensor([int(t[p // BS]) * BS + p % BS for p, t in rows])
    dec_table = torch.nn.functional.pad(tables[0], (0, 1))[None]
    meta = AttentionMetadata(slots, 1, dec_table, torch.tensor([6]), chunks, least)
    kc = torch.randn(40, BS, KVH, D, generator=g).to(dtype)
    vc = torch.randn(40, BS, KVH, D, generator=g).to(dtype)
    t = len(rows)
    q, k, v = (torch.randn(t, h, D, generator=g).to(dtype) for h in (HEADS, KVH, KVH))
    return meta, q, k, v, kc, vc, rows


def _oracle(q, kc, vc, rows, window):
    """Each row's attention over its sequence's keys at positions <= its own, float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, (pos, table) in enumerate(rows):
        seen = [p for p in range(pos + 1) if window is None or p > pos - window]
        keys = torch.stack([kc[table[p // BS], p % BS] for p in seen]).double()
        vals = torch.stack([vc[table[p // BS], p % BS] for p in seen]).double()
        for h in range(HEADS):
            s = keys[:, h // (HEADS // KVH)] @ q[i, h].double() * D**-0.5
            out[i, h] = torch.softmax(s, 0) @ vals[:, h // (HEADS // KVH)]
    return out


@pytest.mark.parametrize(
    ("least", "window", "dense_rows"),
    [
        (4, None, [(1, 13), (21, 30)]),  # the 12- and 9-token whole prompts
        (10, None, [(1, 13)]),
        (4, 10, [(21, 30)]),  # the window cuts the 12-token prompt: paged
        (0, None, []),  # off
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_whole_long_prompts_go_dense(monkeypatch, least, window, dense_rows, dtype):
    monkeypatch.setenv("LORAFLEET_KERNELS", "triton")
    dense_calls = []
    real = attn._dense_prompt
    monkeypatch.setattr(
        attn, "_dense_prompt", lambda q, *a: dense_calls.append(q.shape[0]) or real(q, *a)
    )
    meta, q, k, v, kc, vc, rows = _step(torch.Generator().manual_seed(3), dtype, least)
    out = torch.full_like(q, float("nan"))
    got = paged_attention(q, k, v, kc, vc, meta, D**-0.5, window, out)
    assert got is out and out.isfinite().all()
    (key,) = [key for key in meta.step_cache if key[0] == "chunks"]
    assert [(s.start, s.stop) for s in meta.step_cache[key][4]] == dense_rows
    assert dense_calls == [b - a for a, b in dense_rows]  # once a layer, per dense prompt
    assert rel_err(out, _oracle(q, kc, vc, rows, window)) < (
        1e-5 if dtype == torch.float32 else 3e-3
    )
    if dense_rows:  # a second layer reuses the step's split
        paged_attention(q, k, v, kc, vc, meta, D**-0.5, window, out)
        assert len(dense_calls) == 2 * len(dense_rows)


@pytest.mark.parametrize(
    ("dtype", "gqa"), [(torch.float16, True), (torch.bfloat16, True), (torch.float32, False)]
)
def test_dense_prompts_call_sdpa_in_a_form_a_fused_kernel_takes(monkeypatch, dtype, gqa):
    """16-bit prompts share KV heads (enable_gqa: FlashAttention on CUDA); float32 ones
    repeat them, so CUDA's memory-efficient kernel runs instead of the math backend's
    [heads, n, n] score matrix. Both equal the per-head float64 reference."""
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((q.shape[1], k.shape[1], v.shape[1], kw["enable_gqa"], kw["is_causal"]))
        return real(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    g = torch.Generator().manual_seed(11)
    n = 19
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (HEADS, KVH, KVH))
    got = attn._dense_prompt(q.to(dtype), k.to(dtype), v.to(dtype), D**-0.5)
    kv_heads = KVH if gqa else HEADS
    assert calls == [(HEADS, kv_heads, kv_heads, gqa, True)]
    want = torch.empty(n, HEADS, D, dtype=torch.float64)
    for h in range(HEADS):
        kh, vh = k[:, h // (HEADS // KVH)].double(), v[:, h // (HEADS // KVH)].double()
        s = q[:, h].double() @ kh.T * D**-0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        want[:, h] = torch.softmax(s, -1) @ vh
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    assert got.dtype == dtype and rel_err(got, want) < tol


def test_layers_of_two_windows_share_the_steps_chunk_tables(monkeypatch):
    """A model whose layers slide over different windows splits the step's chunks per
    window (a window can keep a prompt paged) but pads their block tables once."""
    monkeypatch.setenv("LORAFLEET_KERNELS", "triton")
    meta, q, k, v, kc, vc, rows = _step(torch.Generator().manual_seed(5), torch.float32, 4)
    for window in (None, 10):
        out = torch.full_like(q, float("nan"))
        paged_attention(q, k, v, kc, vc, meta, D**-0.5, window, out)
        assert rel_err(out, _oracle(q, kc, vc, rows, window)) < 1e-5
    splits = [v for key, v in meta.step_cache.items() if key[0] == "chunks"]
    assert len(splits) == 2
    assert splits[0][0] is splits[1][0]  # the tables
    assert len(splits[0][4]) == 2 and len(splits[1][4]) == 1  # window 10 keeps one paged
