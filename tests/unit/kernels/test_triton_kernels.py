"""The Triton kernels in the CPU interpreter against the float64 oracle (small shapes).

bf16 is left to tests/gpu: the interpreter has been seen computing bf16 dots and adds
on raw bit patterns.
"""

import pytest
import torch

from kernels import SegmentMeta, build_meta, lora_expand, lora_shrink
from kernels.testing import (
    TOLERANCE,
    oracle_expand,
    oracle_shrink,
    random_slices,
    rank_major,
    rel_err,
)
from tests.unit.kernels.cases import SLICES, case


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "tokens,hidden,num_slices,rank,distinct,none_frac",
    [
        (1, 600, 1, 8, 1, 0.0),  # decode, split-K + atomics, H not a multiple of BLOCK_K
        (5, 64, 3, 16, 3, 0.4),
        (33, 128, 2, 32, 4, 0.2),  # several tiles per slot
        (20, 96, 3, 1, 2, 0.0),  # rank 1
        (64, 64, 3, 64, 4, 0.1),
        (40, 320, 1, 4, 1, 0.5),  # one adapter, many tiles
    ],
)
def test_shrink_expand_match_oracle(
    triton_backend, dtype, tokens, hidden, num_slices, rank, distinct, none_frac
):
    token_slots, x, lora_a, lora_b = case(
        tokens, hidden, num_slices, rank, distinct, none_frac, dtype
    )
    buf = lora_shrink(x, lora_a, token_slots, scale=0.75)
    assert buf.dtype == torch.float32 and buf.shape == (num_slices, tokens, rank)
    assert rel_err(buf, oracle_shrink(x, lora_a, token_slots, 0.75)) < TOLERANCE[dtype]
    assert buf[:, token_slots < 0].abs().sum() == 0
    y = torch.randn(tokens, sum(SLICES[num_slices])).to(dtype)
    before = y.clone()
    want = oracle_expand(y, buf, lora_b, token_slots)
    assert lora_expand(y, buf, lora_b, token_slots) is y
    assert rel_err(y, want) < TOLERANCE[dtype]
    assert torch.equal(y[token_slots < 0], before[token_slots < 0])


@pytest.mark.parametrize("num_slices", [1, 3])
def test_per_slot_rank_and_overwrite(triton_backend, num_slices):
    """Ranks from the meta cut A rows / B columns; add_inputs=False overwrites poisoned y."""
    token_slots, x, lora_a, lora_b = case(17, 64, num_slices, 16, 4, 0.3, torch.float32)
    ranks = torch.tensor([3, 16, 8, 1], dtype=torch.int32)
    meta = build_meta(token_slots, 4, slot_ranks=ranks)
    buf = lora_shrink(x, lora_a, meta)
    assert (
        rel_err(buf, oracle_shrink(x, lora_a, token_slots, 1.0, ranks)) < TOLERANCE[torch.float32]
    )
    per_tok = ranks[token_slots.clamp_min(0)]
    cut = torch.arange(16)[None, :] >= per_tok[:, None]
    assert buf[:, cut].abs().sum() == 0
    buf = buf.masked_fill(cut, float("nan"))  # garbage beyond each slot's rank is ignored
    y = torch.full((17, sum(SLICES[num_slices])), float("nan"))
    want = oracle_expand(torch.zeros_like(y), buf, lora_b, token_slots, False, ranks)
    lora_expand(y, buf, lora_b, meta, add_inputs=False)
    live = token_slots >= 0
    assert rel_err(y[live], want[live]) < TOLERANCE[torch.float32]
    assert torch.isnan(y[~live]).all()


def test_non_contiguous_inputs(triton_backend):
    token_slots, _, lora_a, lora_b = case(9, 64, 2, 8, 3, 0.2, torch.float16)
    x = torch.randn(64, 18).to(torch.float16).t()[::2]  # [9, 64], strides (2, 18)
    assert not x.is_contiguous()
    buf = lora_shrink(x, lora_a, token_slots)
    assert rel_err(buf, oracle_shrink(x, lora_a, token_slots)) < TOLERANCE[torch.float16]
    wide = torch.randn(9, 100).to(torch.float16)
    y = wide[:, 10 : 10 + 64]
    want = oracle_expand(y, buf, lora_b, token_slots)
    lora_expand(y, buf.transpose(0, 1).contiguous().transpose(0, 1), lora_b, token_slots)
    assert rel_err(y, want) < TOLERANCE[torch.float16]
    assert torch.equal(wide[:, :10], wide[:, :10].clone())


def test_all_tokens_without_adapter(triton_backend):
    token_slots = torch.full((6,), -1)
    x = torch.randn(6, 32)
    lora_a = random_slices(2, [(4, 32)], torch.float32, "cpu", 1.0)
    buf = lora_shrink(x, lora_a, token_slots)
    assert buf.abs().sum() == 0
    y = torch.randn(6, 16)
    before = y.clone()
    lora_expand(y, buf, random_slices(2, [(16, 4)], torch.float32, "cpu", 1.0), token_slots)
    assert torch.equal(y, before)


def test_many_slots_programs_cover_further_tiles(triton_backend):
    """L=128 and 90 adapters in 100 tokens: more valid tiles than tile programs (each
    program computes its further tiles in copies, kernels.meta.tile_copies)."""
    from kernels.meta import tile_programs

    token_slots, x, lora_a, lora_b = case(100, 32, 2, 4, 90, 0.0, torch.float32, slots=128)
    meta = build_meta(token_slots, 128)
    assert meta.num_tiles.item() > tile_programs(100, 128, meta.block_m)
    buf = lora_shrink(x, lora_a, meta)
    assert rel_err(buf, oracle_shrink(x, lora_a, token_slots)) < TOLERANCE[torch.float32]
    y = torch.randn(100, sum(SLICES[2]))
    want = oracle_expand(y, buf, lora_b, token_slots)
    lora_expand(y, buf, lora_b, meta)
    assert rel_err(y, want) < TOLERANCE[torch.float32]


@pytest.mark.parametrize(
    "tokens,distinct,block_m,expected,copies",
    [(70, 9, 16, 1, 4), (70, 9, 16, 3, 4), (70, 9, 16, 4, 2), (70, 9, 16, 9, 2),
     (16, 12, 16, 1, 8), (70, 9, 32, 1, 4), (70, 9, 16, None, 1)],
)  # fmt: skip
def test_expected_slots_below_the_batch_still_compute_every_tile(
    triton_backend, monkeypatch, tokens, distinct, block_m, expected, copies
):
    """SegmentMeta.expected_slots sizes the tile grids for that many slots; a batch with
    more (9 adapters over 70 tokens: ~13 tiles of 16 rows; 12 over 16) is still computed
    whole, the extra tiles in each program's further copies (8 with the cap raised to 8:
    13 possible tiles over 2 programs); with as many as expected or more, the copies
    find no tile."""
    from kernels import meta as kmeta
    from kernels.meta import SegmentMeta, tile_copies, tile_programs

    monkeypatch.setattr(kmeta, "MAX_TILE_COPIES", max(copies, kmeta.MAX_TILE_COPIES))
    token_slots, x, lora_a, lora_b = case(tokens, 48, 3, 8, distinct, 0.1, torch.float32, slots=12)
    ranks = torch.tensor([8, 3, 5, 8, 1, 8, 7, 2, 8, 6, 4, 8], dtype=torch.int32)
    out = SegmentMeta.empty(tokens, 12, torch.device("cpu"), block_m, expected_slots=expected)
    meta = build_meta(token_slots, 12, slot_ranks=ranks, out=out)
    programs = tile_programs(tokens, 12, block_m, expected)
    assert tile_copies(tokens, 12, block_m, programs) == copies
    buf = lora_shrink(x, lora_a, meta, scale=0.5)
    want = oracle_shrink(x, lora_a, token_slots, 0.5, ranks)
    assert rel_err(buf, want) < TOLERANCE[torch.float32]
    y0 = torch.randn(tokens, sum(SLICES[3]))
    y = y0.clone()
    lora_expand(y, buf, lora_b, meta)
    assert (
        rel_err(y, oracle_expand(y0, buf, lora_b, token_slots, True, ranks))
        < TOLERANCE[torch.float32]
    )
    assert torch.equal(y[token_slots < 0], y0[token_slots < 0])


@pytest.mark.parametrize(
    "bm,br,max_n,late",
    [(16, 16, 4096, True), (16, 64, 4096, True), (16, 64, 14336, True), (16, 16, 14336, False),
     (16, 128, 4096, False), (32, 64, 4096, False), (32, 16, 4096, False), (64, 64, 4096, False)],
)  # fmt: skip
def test_expand_adds_old_y_late_only_on_decode_tiles(bm, br, max_n, late):
    """ExpandConfig.late_add where the H200 grid found it faster: decode tiles, not rank-16
    wide slices (benchmarks/results/lora_kernels_tune_h200.json run 19)."""
    from kernels.triton.lora_expand import default_config

    assert default_config(bm, br, max_n).late_add is late


@pytest.mark.parametrize("num_slices", [2, 3])
def test_prefill_tiles_fuse_slices(triton_backend, num_slices):
    """block_m 32 (prefill) makes one shrink program compute all slices from one x tile."""
    from kernels.triton.lora_shrink import default_config

    assert default_config(32, 16, 4).fuse_slices and not default_config(16, 16, 4).fuse_slices
    token_slots, x, lora_a, lora_b = case(50, 96, num_slices, 8, 3, 0.2, torch.float32)
    meta = build_meta(token_slots, 4, out=SegmentMeta.empty(50, 4, torch.device("cpu"), block_m=32))
    buf = lora_shrink(x, lora_a, meta, scale=2.0)
    assert rel_err(buf, oracle_shrink(x, lora_a, token_slots, 2.0)) < TOLERANCE[torch.float32]
    y = torch.randn(50, sum(SLICES[num_slices]))
    want = oracle_expand(y, buf, lora_b, token_slots)
    lora_expand(y, buf, lora_b, meta)
    assert rel_err(y, want) < TOLERANCE[torch.float32]


TUNINGS = {  # default; many K splits and one column tile per item; splits + several tiles per item
    "default": None,
    "split_k": dict(
        shrink_items_per_program=64, expand_items_per_program=64, block_n=16, block_k=16
    ),
    "chunks": dict(
        shrink_items_per_program=8, expand_items_per_program=0.01, block_n=16, block_k=32
    ),
}


@pytest.fixture(params=list(TUNINGS))
def fused_tuning(request, monkeypatch):
    """The interpreter runs one program, so force the split-K and column-chunk paths."""
    from kernels.triton import lora_fused

    knobs = TUNINGS[request.param]
    tuning = None if knobs is None else lora_fused.FusedTuning(**knobs)
    monkeypatch.setattr(lora_fused, "TUNING_OVERRIDE", tuning)
    monkeypatch.setattr(lora_fused, "FUSED_MAX_TOKENS", 1 << 30)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "tokens,hidden,num_slices,rank,distinct,none_frac",
    [
        (1, 200, 1, 8, 1, 0.0),  # H not a multiple of BLOCK_K
        (5, 64, 3, 16, 3, 0.4),
        (33, 128, 2, 32, 4, 0.2),
        (20, 96, 3, 1, 2, 0.0),
        (70, 64, 3, 128, 4, 0.1),  # rank 128: slices in separate shrink items
    ],
)
def test_fused_matches_oracle(
    triton_backend, fused_tuning, dtype, tokens, hidden, num_slices, rank, distinct, none_frac
):
    from kernels import lora_shrink_expand

    token_slots, x, lora_a, lora_b = case(
        tokens, hidden, num_slices, rank, distinct, none_frac, dtype
    )
    y = torch.randn(tokens, sum(SLICES[num_slices])).to(dtype)
    before = y.clone()
    want = oracle_expand(y, oracle_shrink(x, lora_a, token_slots, 0.75), lora_b, token_slots)
    meta = build_meta(token_slots, 4)
    assert lora_shrink_expand(y, x, lora_a, lora_b, meta, scale=0.75) is y
    assert rel_err(y, want) < TOLERANCE[dtype]
    assert torch.equal(y[token_slots < 0], before[token_slots < 0])
    assert meta.sync.abs().sum() == 0  # the last program resets flags and counter


@pytest.mark.parametrize("num_slices", [1, 3])
def test_fused_per_slot_rank_and_overwrite(triton_backend, fused_tuning, num_slices):
    from kernels import lora_shrink_expand

    token_slots, x, lora_a, lora_b = case(17, 64, num_slices, 16, 4, 0.3, torch.float32)
    ranks = torch.tensor([3, 16, 8, 1], dtype=torch.int32)
    meta = build_meta(token_slots, 4, slot_ranks=ranks)
    buf = oracle_shrink(x, lora_a, token_slots, 1.0, ranks)
    want = oracle_expand(torch.zeros(17, sum(SLICES[num_slices])), buf, lora_b, token_slots,
                         False, ranks)  # fmt: skip
    y = torch.full((17, sum(SLICES[num_slices])), float("nan"))
    lora_shrink_expand(y, x, lora_a, lora_b, meta, add_inputs=False)
    live = token_slots >= 0
    assert rel_err(y[live], want[live]) < TOLERANCE[torch.float32]
    assert torch.isnan(y[~live]).all()


def test_fused_equals_unfused_on_non_contiguous_inputs(triton_backend):
    from kernels import lora_shrink_expand

    token_slots, _, lora_a, lora_b = case(9, 64, 2, 8, 3, 0.2, torch.float16)
    x = torch.randn(64, 18).to(torch.float16).t()[::2]  # [9, 64], strides (2, 18)
    wide = torch.randn(9, 100).to(torch.float16)
    keep = wide.clone()
    y = wide[:, 10 : 10 + 64]
    want = oracle_expand(y, oracle_shrink(x, lora_a, token_slots), lora_b, token_slots)
    lora_shrink_expand(y, x, lora_a, lora_b, token_slots)
    assert rel_err(y, want) < TOLERANCE[torch.float16]
    assert torch.equal(wide[:, :10], keep[:, :10]) and torch.equal(wide[:, 74:], keep[:, 74:])


def test_fused_all_tokens_without_adapter(triton_backend):
    from kernels import lora_shrink_expand

    token_slots = torch.full((6,), -1)
    y = torch.randn(6, 16)
    before = y.clone()
    a = random_slices(2, [(4, 32)], torch.float32, "cpu", 1.0)
    b = random_slices(2, [(16, 4)], torch.float32, "cpu", 1.0)
    lora_shrink_expand(y, torch.randn(6, 32), a, b, token_slots)
    assert torch.equal(y, before)


def test_shrink_expand_default_route_uses_the_workspace(triton_backend, monkeypatch):
    """Default (FUSED_MAX_TOKENS 0): separate shrink + expand, shrink output in the caller's
    zeroed workspace; the same result as the fused kernel."""
    from kernels import lora_shrink_expand
    from kernels.triton import lora_fused

    token_slots, x, lora_a, lora_b = case(12, 64, 3, 8, 3, 0.2, torch.float32)
    y0 = torch.randn(12, sum(SLICES[3]))
    want = oracle_expand(y0, oracle_shrink(x, lora_a, token_slots, 0.5), lora_b, token_slots)
    ws = torch.zeros(3, 12, 8)
    y = y0.clone()
    lora_shrink_expand(y, x, lora_a, lora_b, token_slots, scale=0.5, workspace=ws)
    assert rel_err(y, want) < TOLERANCE[torch.float32]
    assert rel_err(ws, oracle_shrink(x, lora_a, token_slots, 0.5)) < TOLERANCE[torch.float32]
    monkeypatch.setattr(lora_fused, "FUSED_MAX_TOKENS", 12)
    fused = y0.clone()
    lora_shrink_expand(fused, x, lora_a, lora_b, token_slots, scale=0.5)
    assert rel_err(fused, want) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("tokens", [5, 40])
def test_rank_major_b_with_unequal_slices(triton_backend, monkeypatch, tokens):
    """B stored rank-major (the engine's slots): per-slice r-strides 48/16/16, n-stride 1;
    the expand, the two-launch op and the fused kernel all read it right."""
    from kernels import lora_shrink_expand
    from kernels.triton import lora_fused

    token_slots, x, lora_a, lora_b = case(tokens, 64, 3, 8, 3, 0.2, torch.float32)
    b_rm = rank_major(lora_b)
    assert b_rm[0].stride() == (8 * 48, 1, 48) and b_rm[1].stride() == (8 * 16, 1, 16)
    ranks = torch.tensor([8, 3, 5, 8], dtype=torch.int32)
    meta = build_meta(token_slots, 4, slot_ranks=ranks)
    y0 = torch.randn(tokens, sum(SLICES[3]))
    buf = oracle_shrink(x, lora_a, token_slots, 1.0, ranks).float()
    want = oracle_expand(y0, buf, lora_b, token_slots, True, ranks)
    y = y0.clone()
    lora_expand(y, buf, b_rm, meta)
    assert rel_err(y, want) < TOLERANCE[torch.float32]
    y = y0.clone()
    lora_shrink_expand(y, x, lora_a, b_rm, meta)
    assert rel_err(y, want) < TOLERANCE[torch.float32]
    monkeypatch.setattr(lora_fused, "FUSED_MAX_TOKENS", tokens)
    y = y0.clone()
    lora_shrink_expand(y, x, lora_a, b_rm, meta)
    assert rel_err(y, want) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("num_slices,n_iters", [(3, 2), (2, 3), (1, 4)])
def test_expand_column_groups_span_several_blocks(triton_backend, monkeypatch, num_slices, n_iters):
    """ExpandConfig.n_iters > 1: each program writes n_iters blocks of one slice, reading
    its shrink rows once; groups end mid-slice (masked blocks) and never cross slices."""
    from kernels.triton import lora_expand as ex

    tokens = 37
    token_slots, x, lora_a, lora_b = case(tokens, 64, num_slices, 8, 3, 0.2, torch.float32)
    ranks = torch.tensor([8, 3, 5, 8], dtype=torch.int32)
    meta = build_meta(token_slots, 4, slot_ranks=ranks)
    y0 = torch.randn(tokens, sum(SLICES[num_slices]))
    buf = oracle_shrink(x, lora_a, token_slots, 1.0, ranks).float()
    want = oracle_expand(y0, buf, lora_b, token_slots, True, ranks)
    monkeypatch.setattr(ex, "CONFIG_OVERRIDE", ex.ExpandConfig(16, n_iters=n_iters, num_stages=2))
    for b in (lora_b, rank_major(lora_b)):
        y = y0.clone()
        lora_expand(y, buf, b, meta)
        assert rel_err(y, want) < TOLERANCE[torch.float32]
        assert torch.equal(y[token_slots < 0], y0[token_slots < 0])
