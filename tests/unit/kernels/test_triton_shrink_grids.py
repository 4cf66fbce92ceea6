"""The shrink's launch grids in the CPU interpreter against the float64 oracle: stream-K,
the fused-slices split-K grid (stacked slices, a tail slice), K split bounds and the
decode split for the expected tiles, and rows past a tile (lean x reads).
"""

import pytest
import torch

from kernels import SegmentMeta, build_meta, lora_shrink
from kernels.testing import TOLERANCE, oracle_shrink, random_slices, rel_err
from tests.unit.kernels.cases import case


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "tokens,hidden,num_slices,fuse,per_sm,block_k",
    [
        (37, 200, 3, True, 1, 32),  # runs cross tiles; H not a multiple of BLOCK_K
        (37, 200, 3, False, 1, 64),  # per-slice groups
        (70, 128, 2, True, 3, 16),  # 32-row tiles, runs of ~2 items
        (5, 64, 1, False, 64, 16),  # more programs than items: one item or none each
        (50, 96, 1, True, 2, 32),  # runs that cover whole tiles (plain stores) and parts
    ],
)
@pytest.mark.parametrize("lean_x", [True, False])
def test_stream_k_shrink_matches_oracle(
    triton_backend, monkeypatch, dtype, tokens, hidden, num_slices, fuse, per_sm, block_k, lean_x
):
    """ShrinkConfig.stream_k: equal runs of (tile, k-step) items per program, tile
    boundaries inside a run, per-slot ranks, slot -1 rows left zero, scale applied; x
    tiles read with and without the row mask (lean_x)."""
    from kernels.triton import lora_shrink as sh

    token_slots, x, lora_a, _ = case(tokens, hidden, num_slices, 16, 4, 0.2, dtype)
    ranks = torch.tensor([16, 5, 9, 1], dtype=torch.int32)
    meta = build_meta(token_slots, 4, slot_ranks=ranks)
    cfg = sh.ShrinkConfig(block_k, per_sm, fuse, num_stages=2, stream_k=True, lean_x=lean_x)
    monkeypatch.setattr(sh, "CONFIG_OVERRIDE", cfg)
    out = torch.zeros(num_slices, tokens, 16)  # zeroed, as kernels.lora_shrink's out must be
    buf = lora_shrink(x, lora_a, meta, scale=0.5, out=out)
    want = oracle_shrink(x, lora_a, token_slots, 0.5, ranks)
    assert rel_err(buf, want) < TOLERANCE[dtype]
    assert buf[:, token_slots < 0].abs().sum() == 0
    per_tok = ranks[token_slots.clamp_min(0)]
    assert buf[:, torch.arange(16)[None, :] >= per_tok[:, None]].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "tokens,hidden,num_slices,rank,ranks,per_sm,block_k",
    [
        (37, 200, 3, 16, (16, 5, 9, 1), 1, 32),  # 3 x 16 rows stacked into 64; H % BLOCK_K
        (70, 128, 2, 16, (16, 16, 3, 16), 3, 16),  # 2 x 16 = 32 rows: no padding slice
        (45, 96, 3, 32, (32, 17, 2, 30), 2, 32),  # 3 x 32 into 128
        (70, 96, 2, 64, (64, 16, 33, 64), 2, 32),  # gate_up rank 64: 2 x 64 = 128 rows
        (50, 96, 3, 64, (64, 20, 40, 64), 2, 32),  # qkv rank 64: 256 rows, or 128 + a tail
        (40, 64, 2, 8, (8, 8, 8, 8), 64, 16),  # rank 8 in 16-row blocks; more splits than steps
    ],
)
@pytest.mark.parametrize("stack", ["pow2", "tail", None])
def test_split_k_fused_slices_match_oracle(
    triton_backend, monkeypatch, dtype, tokens, hidden, num_slices, rank, ranks, per_sm, block_k,
    stack,
):  # fmt: skip
    """The fused-slices split-K grid, its slices' A rows stacked into one operand
    (ShrinkConfig.stack_slices; "tail": the last of 3 slices its own dot, stack_tail) or
    one dot per slice: per-slot ranks below the rank block, the padding slice of a stacked
    operand, K splits meeting through atomics, strided x."""
    from kernels.triton import lora_shrink as sh
    from kernels.triton.common import block_r
    from kernels.triton.shrink_plan import stack_tail_for

    token_slots, x, lora_a, _ = case(tokens, hidden, num_slices, rank, 4, 0.2, dtype)
    x = torch.cat([x, torch.randn_like(x)], 1)[:, :hidden]  # row stride 2H
    slot_ranks = torch.tensor(ranks, dtype=torch.int32)
    empty = SegmentMeta.empty(tokens, 4, x.device, block_m=32)
    meta = build_meta(token_slots, 4, slot_ranks=slot_ranks, out=empty)
    cfg = sh.ShrinkConfig(
        block_k, per_sm, True, num_stages=2, stack_slices=bool(stack), stack_tail=stack == "tail"
    )
    if stack == "tail" and num_slices == 3:  # every 3-slice case here pads a power of two
        assert stack_tail_for(cfg, num_slices, block_r(rank))
    monkeypatch.setattr(sh, "CONFIG_OVERRIDE", cfg)
    out = torch.zeros(num_slices, tokens, rank)  # zeroed, as kernels.lora_shrink's out must be
    buf = lora_shrink(x, lora_a, meta, scale=0.5, out=out)
    want = oracle_shrink(x, lora_a, token_slots, 0.5, slot_ranks)
    assert rel_err(buf, want) < TOLERANCE[dtype]
    assert buf[:, token_slots < 0].abs().sum() == 0
    per_tok = slot_ranks[token_slots.clamp_min(0)]
    assert buf[:, torch.arange(rank)[None, :] >= per_tok[:, None]].abs().sum() == 0


@pytest.mark.parametrize("expected", [1, 3, None])
def test_stacked_tail_in_64_row_tiles_matches_oracle(triton_backend, monkeypatch, expected):
    """The qkv rank-64 plan in 64-row tiles (q and k stacked, v its own dot) with per-slot
    ranks: right whether the step holds fewer, as many or more slots than expected (3)."""
    from kernels.triton import lora_shrink as sh

    token_slots, x, lora_a, _ = case(150, 256, 3, 64, 3, 0.1, torch.float32)
    cfg = sh.default_config(64, 64, 4, 3, 256)
    assert cfg.stack_tail and not cfg.stream_k
    monkeypatch.setattr(sh, "CONFIG_OVERRIDE", cfg)
    ranks = torch.tensor([64, 40, 64, 9], dtype=torch.int32)
    empty = SegmentMeta.empty(150, 4, x.device, block_m=64, expected_slots=expected)
    meta = build_meta(token_slots, 4, slot_ranks=ranks, out=empty)
    buf = lora_shrink(x, lora_a, meta, scale=0.5)
    assert (
        rel_err(buf, oracle_shrink(x, lora_a, token_slots, 0.5, ranks)) < TOLERANCE[torch.float32]
    )
    assert buf[:, token_slots < 0].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_slices,rank", [(3, 16), (2, 16), (3, 64)])
def test_stacked_decode_tiles_match_oracle(triton_backend, dtype, num_slices, rank):
    """The default plan for a decode step of many adapters with 1-2 tokens each (all
    slices stacked in one program, shrink_plan._stacks_decode; qkv's v a tail dot) in
    16-row tiles, per-slot ranks, slot -1 rows, K split for the expected tiles."""
    from kernels.triton import lora_shrink as sh

    slots, tokens = 32, 48
    token_slots, x, lora_a, _ = case(tokens, 256, num_slices, rank, 30, 0.1, dtype, slots)
    ranks = torch.randint(1, rank + 1, (slots,), dtype=torch.int32)
    empty = SegmentMeta.empty(tokens, slots, x.device, block_m=16, expected_slots=32)
    meta = build_meta(token_slots, slots, slot_ranks=ranks, out=empty)
    cfg = sh.shrink_config(x, sh.check_x_a(x, lora_a), meta)
    assert cfg.fuse_slices and cfg.stack_tail and cfg.split_for_expected
    buf = lora_shrink(x, lora_a, meta, scale=0.5)
    assert rel_err(buf, oracle_shrink(x, lora_a, token_slots, 0.5, ranks)) < TOLERANCE[dtype]
    assert buf[:, token_slots < 0].abs().sum() == 0
    per_tok = ranks[token_slots.clamp_min(0)]
    assert buf[:, torch.arange(rank)[None, :] >= per_tok[:, None]].abs().sum() == 0


@pytest.mark.parametrize("max_k", [32, 256])
def test_max_k_per_split_matches_oracle(triton_backend, monkeypatch, max_k):
    """ShrinkConfig.max_k_per_split bounds one program's K: 32 over H = 200 makes 7 splits
    meet through atomics; 256 lets one program take all of K (a plain store)."""
    from kernels.triton import lora_shrink as sh

    cfg = sh.ShrinkConfig(32, 1, False, num_stages=2, max_k_per_split=max_k)
    monkeypatch.setattr(sh, "CONFIG_OVERRIDE", cfg)
    token_slots, x, lora_a, _ = case(40, 200, 3, 16, 3, 0.2, torch.float32)
    buf = lora_shrink(x, lora_a, token_slots, scale=0.5)
    assert rel_err(buf, oracle_shrink(x, lora_a, token_slots, 0.5)) < TOLERANCE[torch.float32]
    assert buf[:, token_slots < 0].abs().sum() == 0


def test_decode_split_counts_expected_tiles_not_programs(triton_backend, monkeypatch):
    """The launcher sizes the decode split by the tiles the step can have, not by the tile
    programs it launches (the tile-copy cap adds empty ones: 40 tokens in 64 slots, 1
    adapter expected: 4 tiles, 11 programs)."""
    from kernels.triton import lora_shrink as sh

    seen = []
    real = sh.split_k
    monkeypatch.setattr(
        sh, "split_k", lambda cfg, g, tiles, *a: seen.append(tiles) or real(cfg, g, tiles, *a)
    )
    token_slots = torch.full((40,), 7)
    x = torch.randn(40, 64)
    lora_a = random_slices(64, [(16, 64)], torch.float32, "cpu", 0.1)
    out = SegmentMeta.empty(40, 64, torch.device("cpu"), 16, expected_slots=1)
    buf = lora_shrink(x, lora_a, build_meta(token_slots, 64, out=out))
    assert seen == [4] and sh.tile_programs(40, 64, 16, 1) == 11
    assert rel_err(buf, oracle_shrink(x, lora_a, token_slots)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("expected", [1, 4, None])
def test_decode_split_for_expected_matches_oracle(triton_backend, monkeypatch, expected):
    """split_for_expected with K split over programs sized for `expected` adapters (4 in
    the batch): splits meet through atomics, extra tiles in further copies."""
    from kernels.triton import lora_shrink as sh

    cfg = sh.ShrinkConfig(32, 64, False, num_stages=2, num_warps=2, split_for_expected=True)
    monkeypatch.setattr(sh, "CONFIG_OVERRIDE", cfg)
    token_slots, x, lora_a, _ = case(40, 200, 3, 16, 4, 0.1, torch.float32, slots=6)
    out = SegmentMeta.empty(40, 6, torch.device("cpu"), 16, expected_slots=expected)
    meta = build_meta(token_slots, 6, out=out)
    assert sh.split_k(cfg, 3, sh.expected_tiles(40, 6, 16, expected), 200, 16, x.device)[2] > 1
    buf = lora_shrink(x, lora_a, meta, scale=0.5)
    assert rel_err(buf, oracle_shrink(x, lora_a, token_slots, 0.5)) < TOLERANCE[torch.float32]
    assert buf[:, token_slots < 0].abs().sum() == 0


@pytest.mark.parametrize("stream_k", [False, True])
@pytest.mark.parametrize("lean_x", [True, False])
def test_shrink_rows_past_a_tile_do_not_leak(triton_backend, monkeypatch, stream_k, lean_x):
    """With lean_x the rows past a tile's tokens read x's row 0 instead of being masked.
    Here row 0 is a slot -1 token full of NaN: every other token's sums stay exact and
    finite (the padded rows' sums are never stored), token 0's stay zero."""
    from kernels.triton import lora_shrink as sh

    cfg = sh.ShrinkConfig(32, 2, not stream_k, num_stages=2, stream_k=stream_k, lean_x=lean_x)
    monkeypatch.setattr(sh, "CONFIG_OVERRIDE", cfg)
    token_slots, x, lora_a, _ = case(45, 96, 3, 16, 3, 0.1, torch.float32)
    token_slots[0] = -1
    x[0] = float("nan")
    buf = lora_shrink(x, lora_a, token_slots, scale=0.5)
    clean = x.clone()
    clean[0] = 0.0
    assert torch.isfinite(buf).all() and buf[:, 0].abs().sum() == 0
    assert rel_err(buf, oracle_shrink(clean, lora_a, token_slots, 0.5)) < TOLERANCE[torch.float32]
