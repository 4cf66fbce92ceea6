"""kernels.paged_attention: the Triton kernel in the CPU interpreter against the float64
oracle (the reference on float64 copies) on fresh random caches, block tables and
queries, with the output poisoned first; decode with and without key splits, prompt
chunks over several tiles, grouped heads (a non-power-of-two group), a head size that is
not a power of two, sliding windows, strided q; the CPU reference; argument refusals.

bf16 is left to tests/gpu (see test_triton_kernels.py: the interpreter's bf16 dots).
"""

from __future__ import annotations

import pytest
import torch

import kernels.triton.paged_attention as pa
from kernels import paged_attention
from kernels.attention_reference import paged_attention_ref
from kernels.testing import rel_err

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _cache(blocks, bs, kvh, d, dtype):
    return torch.randn(blocks, bs, kvh, d).to(dtype), torch.randn(blocks, bs, kvh, d).to(dtype)


def _tables(seqs, width, blocks):
    """Each sequence its own random blocks (no two sequences share one)."""
    perm = torch.randperm(blocks)[: seqs * width]
    return perm.view(seqs, width)


def _oracle(q, kc, vc, tables, ctx, scale, window, query_lens):
    return paged_attention_ref(
        q.double(), kc.double(), vc.double(), tables, ctx, scale=scale, window=window,
        query_lens=query_lens,
    )  # fmt: skip


DECODE = [  # heads, kv_heads, d, block size, contexts, window
    (8, 2, 32, 4, [1, 4, 5, 23], None),  # group 4; contexts at and across block ends
    (6, 2, 24, 4, [7, 16, 2], None),  # group 3 (rows past 3 a program masked), d 24 in 32
    (4, 4, 16, 8, [30, 9], 6),  # no grouping; a window shorter than the contexts
    (8, 1, 32, 16, [40, 3, 17], 64),  # one kv head; a window longer than every context
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("heads", "kvh", "d", "bs", "ctx", "window"), DECODE)
@pytest.mark.parametrize("split", [False, True])
def test_decode_matches_oracle(
    monkeypatch, triton_backend, dtype, heads, kvh, d, bs, ctx, window, split
):
    """split: each sequence's keys split over programs of 16 keys (flash-decoding), some
    of them past the context (no keys), and merged."""
    if split:
        monkeypatch.setattr(pa, "SPLIT_MIN_KEYS", 2)
        monkeypatch.setattr(pa, "tile_shape", lambda *a: pa.Tiles(16, 16, 1))
        monkeypatch.setattr(pa, "num_sms", lambda device: 64)  # few programs: split
    width = -(-max(ctx) // bs) + 1  # a padded table, as the decode graphs' buckets have
    kc, vc = _cache(len(ctx) * width + 3, bs, kvh, d, dtype)
    tables = _tables(len(ctx), width, kc.shape[0])
    lens = torch.tensor(ctx)
    q = torch.randn(len(ctx), heads, d).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = d**-0.5
    if split:
        assert pa.decode_splits(len(ctx), kvh, width * bs if window is None else window,
                                q.device) > 1  # fmt: skip
    got = paged_attention(q, kc, vc, tables, lens, scale=scale, window=window, out=out)
    assert got is out and out.isfinite().all()
    assert rel_err(out, _oracle(q, kc, vc, tables, ctx, scale, window, None)) < TOL[dtype]


CHUNKS = [  # heads, kv_heads, d, block size, query counts, contexts, window
    (8, 2, 32, 4, [5, 1, 37], [5, 9, 40], None),  # group 4: 16-query tiles, 37 -> 3 tiles
    (6, 2, 16, 4, [30, 2], [30, 33], None),  # group 3: 21-query tiles
    (4, 4, 32, 8, [70, 0, 3], [75, 4, 3], 9),  # no group: 64-query tiles; an empty chunk
    (8, 8, 16, 4, [20], [26], 50),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("heads", "kvh", "d", "bs", "qlens", "ctx", "window"), CHUNKS)
def test_chunks_match_oracle(triton_backend, dtype, heads, kvh, d, bs, qlens, ctx, window):
    width = -(-max(ctx) // bs)
    kc, vc = _cache(len(ctx) * width + 2, bs, kvh, d, dtype)
    tables = _tables(len(ctx), width, kc.shape[0])
    q = torch.randn(sum(qlens), heads, d).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = d**-0.5
    paged_attention(q, kc, vc, tables, ctx, scale=scale, window=window, query_lens=qlens, out=out)
    assert out.isfinite().all()
    want = _oracle(q, kc, vc, tables, ctx, scale, window, qlens)
    assert rel_err(out, want) < TOL[dtype]


@pytest.mark.parametrize("decode", [True, False])
def test_full_key_steps_skip_the_mask(monkeypatch, triton_backend, decode):
    """16-key steps over contexts of up to 83 keys: the steps every row of a tile sees
    whole run unmasked, the rest masked; the same output as masking every step, and the
    oracle's, with key splits (decode) and chunks after cached keys (float16: float32 masks
    every step)."""
    heads, kvh, d, bs = 8, 2, 32, 4
    ctx, qlens = [83, 17, 64, 48], [9, 17, 1, 30]
    monkeypatch.setattr(pa, "tile_shape", lambda *a: pa.Tiles(16, 16, 1 if decode else 4))
    if decode:
        monkeypatch.setattr(pa, "SPLIT_MIN_KEYS", 32)
        monkeypatch.setattr(pa, "num_sms", lambda device: 8)  # 2 splits of 48 keys
        qlens = None
    width = -(-max(ctx) // bs)
    kc, vc = _cache(len(ctx) * width, bs, kvh, d, torch.float16)
    tables = _tables(len(ctx), width, kc.shape[0])
    q = torch.randn(len(ctx) if decode else sum(qlens), heads, d).half()
    lens = torch.tensor(ctx) if decode else ctx
    outs = []
    for unmasked in (True, False):
        monkeypatch.setattr(pa, "UNMASKED_FULL", unmasked)
        out = torch.full_like(q, float("nan"))
        paged_attention(q, kc, vc, tables, lens, scale=d**-0.5, query_lens=qlens, out=out)
        outs.append(out)
    want = _oracle(q, kc, vc, tables, ctx, d**-0.5, None, qlens)
    assert rel_err(outs[0], want) < TOL[torch.float16]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_tiles_cover_every_query_once():
    """prefill_tiles: BLOCK_Q-query tiles, each its first row, count, first position and
    sequence, covering each sequence's queries, the tiles that reach furthest first."""
    tiles = pa.prefill_tiles([5, 0, 37], [5, 3, 40], 16, torch.device("cpu")).tolist()
    assert tiles == [
        [37, 5, 35, 2], [21, 16, 19, 2], [5, 16, 3, 2],
        [0, 5, 0, 0],
    ]  # fmt: skip
    bf16, fp32 = torch.bfloat16, torch.float32
    assert pa.tile_shape(4, bf16, 128, False) == pa.Tiles(64, 64, 16)
    assert pa.tile_shape(3, bf16, 128, False).block_q == 21  # rows past 63 masked
    assert pa.tile_shape(128, bf16, 128, False) == pa.Tiles(128, 64, 1)
    assert pa.tile_shape(4, bf16, 128, True) == pa.Tiles(16, 64, 1)
    assert pa.tile_shape(4, fp32, 128, False) == pa.Tiles(16, 32, 4)
    assert pa.tile_shape(4, bf16, 256, False).block_n == 32


def test_strided_q_and_out(triton_backend):
    """q a view of a fused qkv row (stride 0 past heads x d), out a view as well."""
    kc, vc = _cache(12, 4, 2, 16, torch.float32)
    tables = _tables(2, 5, 12)
    qkv = torch.randn(2, 3 * 4 * 16)
    q = qkv[:, : 4 * 16].view(2, 4, 16)
    wide = torch.full((2, 6, 16), float("nan"))
    out = wide[:, 1:5]
    lens = torch.tensor([13, 20])
    paged_attention(q, kc, vc, tables, lens, scale=0.25, out=out)
    assert rel_err(out, _oracle(q, kc, vc, tables, [13, 20], 0.25, None, None)) < 1e-5
    assert wide[:, 0].isnan().all() and wide[:, 5].isnan().all()  # nothing outside out


def test_reference_backend_matches_oracle():
    """The CPU backend (auto on CPU tensors) is the reference: the oracle's values in float32."""
    kc, vc = _cache(20, 4, 2, 16, torch.float32)
    tables = _tables(3, 6, 20)
    q = torch.randn(7, 8, 16)
    got = paged_attention(q, kc, vc, tables, [3, 9, 21], scale=0.25, query_lens=[2, 1, 4])
    assert rel_err(got, _oracle(q, kc, vc, tables, [3, 9, 21], 0.25, None, [2, 1, 4])) < 1e-6


def _args():
    kc, vc = _cache(8, 4, 2, 16, torch.float32)
    return torch.randn(2, 4, 16), kc, vc, _tables(2, 3, 8), torch.tensor([5, 9])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "q": a["q"][0]}, "q: a 3-D"),
        (lambda a: {**a, "q": a["q"].double()}, "q: a 3-D"),
        (lambda a: {**a, "k_cache": a["k_cache"].half()}, "k_cache is torch.float16"),
        (lambda a: {**a, "v_cache": a["v_cache"][:4]}, "v_cache: \\[4"),
        (lambda a: {**a, "k_cache": a["k_cache"][..., :8]}, "last dim 8"),
        (lambda a: {**a, "q": torch.randn(2, 3, 16)}, "a multiple of the caches' 2"),
        (lambda a: {**a, "block_tables": a["block_tables"].float()}, "block_tables"),
        (lambda a: {**a, "context_lens": [5, 9]}, "context_lens: decode"),
        (lambda a: {**a, "context_lens": torch.tensor([5])}, "context_lens: decode"),
        (lambda a: {**a, "query_lens": [1, 2]}, "summing to q's 2 rows"),
        (lambda a: {**a, "query_lens": [1, 1], "context_lens": [1, 13]}, "sequence 1"),
        (lambda a: {**a, "query_lens": [2, 0], "context_lens": [1, 3]}, "sequence 0"),
        (lambda a: {**a, "window": 0}, "window"),
        (lambda a: {**a, "out": torch.empty(2, 16, 4).transpose(1, 2)}, "out:"),
    ],
)
def test_refusals(change, message):
    q, kc, vc, tables, lens = _args()
    a = dict(q=q, k_cache=kc, v_cache=vc, block_tables=tables, context_lens=lens)
    a = change(a)
    kw = {k: a.pop(k) for k in ("window", "query_lens", "out") if k in a}
    with pytest.raises(ValueError, match=message):
        paged_attention(
            a["q"], a["k_cache"], a["v_cache"], a["block_tables"], a["context_lens"],
            scale=0.25, **kw,
        )  # fmt: skip


def test_warm_up_launches_every_variant_and_writes_no_cache(triton_backend, monkeypatch):
    """Per distinct window: decode without and with key splits, prompt chunks; the cache
    it is given is only read for its layout."""
    calls = []
    real = pa.paged_attention_triton

    def spy(q, kc, vc, tables, ctx, scale, window, query_lens, out, tiles=None, splits=None):
        calls.append((window, query_lens is None, splits))
        return real(q, kc, vc, tables, ctx, scale, window, query_lens, out, tiles, splits)

    monkeypatch.setattr(pa, "paged_attention_triton", spy)
    kc, _ = _cache(5, 4, 2, 16, torch.float16)
    before = kc.clone()
    assert pa.warm_up(8, kc, [None, 6, None, 6], 0.25) == 6
    assert calls == [
        (None, True, 1), (None, True, 2), (None, False, None),
        (6, True, 1), (6, True, 2), (6, False, None),
    ]  # fmt: skip
    assert torch.equal(kc, before)
