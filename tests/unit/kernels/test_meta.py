"""build_meta: the worked example exactly, and the grouping invariants on random maps."""

import pytest
import torch

from kernels.meta import (
    FULL_RANK,
    MAX_TILE_COPIES,
    MAX_TILE_PROGRAMS,
    SegmentMeta,
    build_meta,
    default_block_m,
    max_tiles,
    tile_copies,
    tile_programs,
)

CPU = torch.device("cpu")


def test_worked_example():
    meta = SegmentMeta.empty(5, 3, CPU, block_m=2)
    got = build_meta(torch.tensor([2, -1, 0, 2, 2]), 3, out=meta)
    assert got is meta
    assert meta.tile_slot.tolist() == [0, 2, 2, -1, -1, -1]
    assert meta.tile_rank.tolist() == [FULL_RANK] * 3 + [0] * 3
    assert meta.tile_tok.tolist() == [[2, -1], [0, 3], [4, -1]] + [[-1, -1]] * 3
    assert meta.num_tiles.tolist() == [3]
    assert meta.slot_ranks.tolist() == [FULL_RANK] * 3
    assert meta.sync.tolist() == [0] * 7


@pytest.mark.parametrize("tokens,slots,block_m", [(1, 1, 16), (7, 3, 2), (64, 8, 16), (300, 64, 4)])
def test_tiles_cover_each_slot_once(tokens, slots, block_m):
    token_slots = torch.randint(-1, slots, (tokens,))
    meta = build_meta(
        token_slots, slots, out=SegmentMeta.empty(tokens, slots, CPU, block_m=block_m)
    )
    assert meta.tile_slot.shape[0] == max_tiles(tokens, slots, block_m)
    assert meta.tile_tok.shape == (meta.max_tiles, block_m)
    seen = {s: [] for s in range(slots)}
    for slot, toks in zip(meta.tile_slot.tolist(), meta.tile_tok.tolist(), strict=True):
        rows = [t for t in toks if t >= 0]
        assert toks == rows + [-1] * (block_m - len(rows))  # padding rows last
        if slot < 0:
            assert rows == []
            continue
        assert 1 <= len(rows) <= block_m
        seen[slot] += rows
    assert (meta.tile_slot >= 0).sum().item() == meta.num_tiles.item()
    assert (meta.tile_slot[: meta.num_tiles.item()] >= 0).all()
    for s in range(slots):
        want = (token_slots == s).nonzero().flatten().tolist()
        assert seen[s] == want  # stable: token order kept inside a slot
        tiles_of_s = [i for i, t in enumerate(meta.tile_slot.tolist()) if t == s]
        assert all(
            len([t for t in meta.tile_tok[i].tolist() if t >= 0]) == block_m
            for i in tiles_of_s[:-1]
        )  # fmt: skip  (only a slot's last tile is partial)


def test_refill_in_place_and_ranks():
    meta = SegmentMeta.empty(6, 4, CPU)
    build_meta(torch.tensor([0, 0, 1, 1, 2, 3]), 4, out=meta)
    meta.sync.fill_(5)  # a build leaves the fused kernel's flags at zero
    build_meta(
        torch.tensor([3, -1, 3, 1, -1, 3]), 4, slot_ranks=torch.tensor([8, 16, 4, 2]), out=meta
    )
    assert meta.tile_slot.tolist()[:2] == [1, 3] and set(meta.tile_slot.tolist()[2:]) == {-1}
    assert meta.tile_tok[:2, :3].tolist() == [[3, -1, -1], [0, 2, 5]]
    assert meta.tile_rank.tolist()[:2] == [16, 2]
    assert meta.slot_ranks.tolist() == [8, 16, 4, 2]
    assert meta.sync.abs().sum() == 0


def test_out_of_range_slots_are_no_work():
    meta = build_meta(torch.tensor([5, 0, -3]), 2)
    assert meta.num_tiles.tolist() == [1]
    assert (meta.tile_tok >= 0).sum().item() == 1 and meta.tile_tok[0, 0] == 1


@pytest.mark.parametrize(
    "slots,num_slots,ranks,out,match",
    [
        (torch.zeros(3), 2, None, None, "token_slots"),
        (torch.zeros(2, 2, dtype=torch.long), 2, None, None, "token_slots"),
        (
            torch.zeros(3, dtype=torch.long),
            2,
            torch.zeros(3, dtype=torch.int32),
            None,
            "slot_ranks",
        ),
        (torch.zeros(3, dtype=torch.long), 2, None, SegmentMeta.empty(4, 2, CPU), "out"),
    ],
)
def test_bad_inputs_raise(slots, num_slots, ranks, out, match):
    with pytest.raises(ValueError, match=match):
        build_meta(slots, num_slots, slot_ranks=ranks, out=out)


def test_bad_block_m():
    with pytest.raises(ValueError, match="block_m"):
        SegmentMeta.empty(4, 2, CPU, block_m=24)


def test_tile_programs_fit_a_grid_dimension():
    """The tile programs are a CUDA grid's y / z dimension: a step past 65535 of them is
    refused with an error naming the limit, not launched with a wrapped grid."""
    assert tile_programs(64, 64, 16) == 4 + 64
    assert tile_programs(16 * (MAX_TILE_PROGRAMS - 64), 64, 16) == MAX_TILE_PROGRAMS
    with pytest.raises(ValueError, match="at most 65535"):
        tile_programs(16 * (MAX_TILE_PROGRAMS - 63), 64, 16)


def test_expected_slots_apply_to_decode_tiles_of_any_rank():
    """kernels.triton.common.grid_expected: the caller's expectation at decode tiles (16
    rows, where the H200 grid measured a smaller tile grid faster at ranks 16 and 64);
    None at prefill tiles or where the SegmentMeta has none (a grid for all slots)."""
    from kernels.triton.common import grid_expected

    def expected_slots(meta):
        return grid_expected(meta.block_m, meta.expected_slots)

    decode = SegmentMeta.empty(64, 8, CPU, max_rank=64, expected_slots=3)
    prefill = SegmentMeta.empty(1024, 8, CPU, max_rank=16, expected_slots=3)
    assert decode.block_m == 16 and prefill.block_m == 32
    assert expected_slots(decode) == 3 and expected_slots(prefill) is None
    assert expected_slots(SegmentMeta.empty(64, 8, CPU)) is None


def test_tile_copies_cover_every_possible_tile():
    """programs x copies >= max_tiles for every grid tile_programs makes; copies a power
    of two <= MAX_TILE_COPIES (programs are raised where fewer would need more)."""
    for tokens in (1, 5, 16, 64, 100, 256, 1000, 4096):
        for slots in (1, 8, 64, 128, 1024):
            for bm in (16, 32, 64):
                for expected in (None, 1, 3, 8, 64):
                    e = None if expected is None else min(expected, slots)
                    p = tile_programs(tokens, slots, bm, e)
                    c = tile_copies(tokens, slots, bm, p)
                    assert p * c >= max_tiles(tokens, slots, bm)
                    assert c & (c - 1) == 0 and c <= MAX_TILE_COPIES
                    if c > 1:  # not more copies than needed, up to the power of two
                        assert p * (c // 2) < max_tiles(tokens, slots, bm)
    assert MAX_TILE_COPIES == 4  # the figures below
    assert tile_programs(64, 64, 16, 32) == 36 and tile_copies(64, 64, 16, 36) == 2
    assert tile_programs(64, 64, 16, 8) == 17 and tile_copies(64, 64, 16, 17) == 4
    assert tile_programs(64, 64, 16, 1) == 17  # 68 tiles: at least ceil(68 / 4) programs
    assert tile_programs(64, 64, 16) == 68 and tile_copies(64, 64, 16, 68) == 1


def test_expected_tiles_count_the_tiles_a_step_can_have():
    """expected_tiles: ceil(T / block_m) + min(slots, T), whatever the grid launched (the
    decode shrink's K split counts these, not the programs the tile-copy cap adds)."""
    from kernels.meta import expected_tiles

    assert expected_tiles(64, 64, 16, 1) == 5 and tile_programs(64, 64, 16, 1) == 17
    assert expected_tiles(64, 64, 16, 8) == 12 and expected_tiles(64, 64, 16) == 68
    assert expected_tiles(5, 64, 16, 32) == 1 + 5  # never more slots than tokens
    assert expected_tiles(64, 4, 16, 32) == 4 + 4  # nor than the pool's


def test_expected_slots_size_the_tile_grid():
    """SegmentMeta.expected_slots: one tile program per tile that many slots could make
    (ceil(T / block_m) + expected), never more than the bound for all L slots."""
    assert tile_programs(64, 16, 16, expected_slots=8) == 4 + 8
    assert tile_programs(256, 16, 16, expected_slots=1) == 16 + 1
    # never fewer than max_tiles / MAX_TILE_COPIES: 68 / 4
    assert tile_programs(64, 64, 16, expected_slots=8) == 17
    assert tile_programs(5, 64, 16, expected_slots=32) == tile_programs(5, 64, 16) == 1 + 5
    assert tile_programs(64, 64, 16, expected_slots=None) == 4 + 64
    meta = SegmentMeta.empty(64, 8, CPU, expected_slots=3)
    assert meta.expected_slots == 3 and meta.max_tiles == 4 + 8  # buffers for all L slots
    built = build_meta(torch.tensor([0, 1, 1, -1]), 8, expected_slots=2)
    assert built.expected_slots == 2
    for bad in (0, 9):
        with pytest.raises(ValueError, match="expected_slots"):
            SegmentMeta.empty(64, 8, CPU, expected_slots=bad)


@pytest.mark.parametrize(
    "tokens,max_rank,expected,want",
    [(1, None, None, 16), (256, 16, None, 16), (257, 64, None, 32), (1024, None, None, 32),
     (1025, None, None, 64), (4096, 64, None, 64), (4096, 32, None, 64), (4096, 16, None, 32),
     (4096, 8, None, 32), (256, 64, 1, 16), (1024, 64, 1, 64), (1024, 64, 16, 64),
     (1023, 64, 16, 32), (1024, 64, 17, 32), (512, None, 8, 64), (1024, 16, 1, 32),
     (4096, 64, 64, 64), (4096, 16, 1, 32)],
)  # fmt: skip
def test_tile_height_follows_tokens_pool_rank_and_expected_slots(tokens, max_rank, expected, want):
    """Above 1024 tokens, pools of rank <= 16 keep 32-row tiles (measured faster on the
    H200); between 257 and 1024, pools of higher rank take 64 rows when the step expects
    at least 64 tokens per slot. build_meta and SegmentMeta.empty take both to pick it."""
    assert default_block_m(tokens, max_rank, expected) == want
    num_slots = 64
    empty = SegmentMeta.empty(tokens, num_slots, CPU, max_rank=max_rank, expected_slots=expected)
    assert empty.block_m == want
    slots = torch.randint(-1, num_slots, (tokens,))
    built = build_meta(slots, num_slots, max_rank=max_rank, expected_slots=expected)
    assert built.block_m == want
    assert SegmentMeta.empty(tokens, 4, CPU, block_m=16, max_rank=max_rank).block_m == 16
    if expected is not None:  # the same without the expectation: 32 rows up to 1024 tokens
        assert default_block_m(tokens, max_rank) == (want if tokens > 1024 or want == 16 else 32)
