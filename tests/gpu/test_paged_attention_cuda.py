"""kernels.paged_attention's Triton kernel on CUDA at real model shapes against the float64
oracle (fresh random caches, block tables and queries, output poisoned first): decode
batches of 1 (key splits) to 128 sequences, prompt chunks over many tiles, grouped heads
of 4, 7 and 8, sliding windows, bf16 / fp16 / fp32; a decode step captured in a CUDA
graph replays with new contexts and tables."""

from __future__ import annotations

import pytest
import torch

import kernels.triton.paged_attention as pa
from kernels import paged_attention
from kernels.attention_reference import paged_attention_ref
from kernels.testing import captured, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
SHAPES = [(32, 8, 128), (28, 4, 128), (64, 8, 128), (16, 2, 64)]  # Llama-3-8B, Qwen2-7B, 70B
BS = 16


def _setup(seqs, max_ctx, kvh, d, dtype):
    width = -(-max_ctx // BS)
    blocks = seqs * width + 4
    kc = torch.randn(blocks, BS, kvh, d, device=CUDA).to(dtype)
    vc = torch.randn(blocks, BS, kvh, d, device=CUDA).to(dtype)
    tables = torch.randperm(blocks, device=CUDA)[: seqs * width].view(seqs, width)
    return kc, vc, tables


def _oracle(q, kc, vc, tables, ctx, scale, window, qlens):
    return paged_attention_ref(
        q.double(), kc.double(), vc.double(), tables, ctx, scale=scale, window=window,
        query_lens=qlens,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("heads", "kvh", "d"), SHAPES)
@pytest.mark.parametrize(("seqs", "max_ctx", "window"), [(1, 3000, None), (7, 700, None),
                                                         (128, 300, None), (5, 900, 256)])  # fmt: skip
def test_decode_matches_oracle(dtype, heads, kvh, d, seqs, max_ctx, window):
    kc, vc, tables = _setup(seqs, max_ctx, kvh, d, dtype)
    ctx = torch.randint(1, max_ctx + 1, (seqs,), device=CUDA)
    ctx[0] = max_ctx
    q = torch.randn(seqs, heads, d, device=CUDA).to(dtype)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, kc, vc, tables, ctx, scale=d**-0.5, window=window, out=out)
    want = _oracle(q, kc, vc, tables, ctx.tolist(), d**-0.5, window, None)
    assert rel_err(out, want) < TOL[dtype]
    if seqs == 1:
        assert pa.decode_splits(1, kvh, tables.shape[1] * BS, CUDA) > 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kvh", "d"), SHAPES)
@pytest.mark.parametrize("window", [None, 200])
def test_chunks_match_oracle(dtype, heads, kvh, d, window):
    """Three chunks: a whole 517-token prompt, a 64-token chunk after 300 cached tokens,
    one token (a prompt's last) after 1000."""
    qlens, ctx = [517, 64, 1], [517, 364, 1001]
    kc, vc, tables = _setup(3, max(ctx), kvh, d, dtype)
    q = torch.randn(sum(qlens), heads, d, device=CUDA).to(dtype)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, kc, vc, tables, ctx, scale=d**-0.5, window=window, query_lens=qlens, out=out)
    assert rel_err(out, _oracle(q, kc, vc, tables, ctx, d**-0.5, window, qlens)) < TOL[dtype]


@pytest.mark.parametrize("seqs", [1, 64])
def test_decode_replays_in_a_cuda_graph(seqs):
    """Captured once, replayed with other contexts and tables in the same buffers."""
    kc, vc, tables = _setup(seqs, 2048, 8, 128, torch.bfloat16)
    ctx = torch.full((seqs,), 5, device=CUDA)
    q = torch.randn(seqs, 32, 128, device=CUDA).to(torch.bfloat16)
    out = torch.empty_like(q)
    graph = captured(lambda: paged_attention(q, kc, vc, tables, ctx, scale=0.08, out=out))
    for _ in range(2):
        ctx.copy_(torch.randint(1, 2049, (seqs,), device=CUDA))
        tables.copy_(tables[torch.randperm(seqs, device=CUDA)])
        q.normal_()
        out.fill_(float("nan"))
        graph.replay()
        want = _oracle(q, kc, vc, tables, ctx.tolist(), 0.08, None, None)
        assert rel_err(out, want) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_engine_step_with_dense_whole_prompts(dtype):
    """replica's paged_attention on CUDA: 2 decode sequences, then a whole 1500-token
    prompt (dense SDPA: dense_prompt_min), 300 tokens after 700 cached and a whole
    200-token prompt (the kernel), against the float64 oracle over the cache it wrote."""
    from replica.layers import attention as attn

    heads, kvh, d = 32, 8, 128
    dec_ctx, chunks = [500, 1200], [(1500, 1500), (300, 1000), (200, 200)]
    ctx = dec_ctx + [c for _, c in chunks]
    kc, vc, tables = _setup(len(ctx), max(ctx), kvh, d, dtype)
    rows, slots = [], []
    for i, c in enumerate(ctx):
        first = c - 1 if i < 2 else c - chunks[i - 2][0]
        for p in range(first, c):
            rows.append(i)
            slots.append(int(tables[i, p // BS]) * BS + p % BS)
    prefills, start = [], 2
    for i, (n, c) in enumerate(chunks):
        prefills.append(attn.PrefillChunk(start, n, c, tables[2 + i]))
        start += n
    meta = attn.AttentionMetadata(torch.tensor(slots, device=CUDA), 2, tables[:2],
                                  torch.tensor(dec_ctx, device=CUDA), prefills)  # fmt: skip
    t = len(rows)
    q = torch.randn(t, heads, d, device=CUDA).to(dtype)
    k, v = (torch.randn(t, kvh, d, device=CUDA).to(dtype) for _ in range(2))
    out = torch.full_like(q, float("nan"))
    attn.paged_attention(q, k, v, kc, vc, meta, d**-0.5, None, out)
    (key,) = [key for key in meta.step_cache if key[0] == "chunks"]
    assert [(s.start, s.stop) for s in meta.step_cache[key][4]] == [(2, 1502)]
    want = torch.cat([
        _oracle(q[:2], kc, vc, tables[:2], dec_ctx, d**-0.5, None, None),
        _oracle(q[2:], kc, vc, tables[2:], [c for _, c in chunks], d**-0.5, None,
                [n for n, _ in chunks]),
    ])  # fmt: skip
    assert out.isfinite().all()
    assert rel_err(out[2:1502], want[2:1502]) < TOL[dtype]  # the dense prompt
    assert rel_err(out, want) < TOL[dtype]
