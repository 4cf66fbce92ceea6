"""The one-program Triton build of SegmentMeta (interpreted) against the torch build, field by field."""

import dataclasses

import pytest
import torch

from kernels.meta import FULL_RANK, SegmentMeta, _build_torch, build_meta
from kernels.testing import slot_map
from kernels.triton import build_meta as triton_build
from kernels.triton.build_meta import build_meta_triton

CPU = torch.device("cpu")


def filled(tokens, num_slots, block_m):
    """A SegmentMeta whose buffers hold junk (sync too): the build must overwrite all of it."""
    meta = SegmentMeta.empty(tokens, num_slots, CPU, block_m=block_m)
    for f in dataclasses.fields(meta):
        value = getattr(meta, f.name)
        if isinstance(value, torch.Tensor):
            value.fill_(7)
    return meta


def assert_same(got: SegmentMeta, want: SegmentMeta):
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{f.name}:\n{a}\n!=\n{b}"
        else:
            assert a == b, f.name


def check(token_slots, num_slots, block_m, slot_ranks=None):
    tokens = token_slots.shape[0]
    want = SegmentMeta.empty(tokens, num_slots, CPU, block_m=block_m)
    _build_torch(token_slots, slot_ranks, want)
    got = filled(tokens, num_slots, block_m)
    build_meta_triton(token_slots, slot_ranks, got)
    assert_same(got, want)
    return got


def test_worked_example():
    meta = check(torch.tensor([2, -1, 0, 2, 2]), 3, 2)
    assert meta.tile_slot.tolist() == [0, 2, 2, -1, -1, -1]
    assert meta.tile_rank.tolist() == [FULL_RANK] * 3 + [0] * 3
    assert meta.tile_tok.tolist() == [[2, -1], [0, 3], [4, -1], [-1, -1], [-1, -1], [-1, -1]]
    assert meta.num_tiles.tolist() == [3]


CASES = [  # T, L, block_m, ranks, none_frac, bad_frac, dtype
    (1, 1, 16, False, 0.0, 0.0, torch.int64),
    (1, 4, 16, True, 1.0, 0.0, torch.int32),  # the only token has no adapter
    (7, 3, 2, True, 0.3, 0.2, torch.int32),
    (37, 1, 4, False, 0.2, 0.1, torch.int64),  # L = 1
    (50, 5, 16, True, 0.0, 0.0, torch.int64),  # L not a power of two
    (13, 40, 16, True, 0.1, 0.1, torch.int32),  # L > T
    (100, 7, 16, False, 1.0, 0.0, torch.int64),  # all -1
    (100, 7, 16, True, 0.0, 1.0, torch.int32),  # all out of range
    (45, 6, 1, True, 0.2, 0.0, torch.int64),  # block_m 1: every token opens a tile
    (257, 31, 32, True, 0.25, 0.05, torch.int64),
    (600, 128, 16, False, 0.1, 0.0, torch.int32),  # L a power of two: key L needs a bit more
    (640, 127, 64, True, 0.0, 0.0, torch.int64),  # keys 0..127: all 7 bits used
]


@pytest.mark.parametrize("tokens,num_slots,block_m,ranks,none_frac,bad_frac,dtype", CASES)
def test_matches_torch_build(tokens, num_slots, block_m, ranks, none_frac, bad_frac, dtype):
    token_slots = slot_map(tokens, num_slots, none_frac, bad_frac, dtype, seed=tokens)
    slot_ranks = torch.randint(1, 65, (num_slots,), dtype=dtype) if ranks else None
    check(token_slots, num_slots, block_m, slot_ranks)


@pytest.mark.parametrize(
    "tokens,num_slots,block_m,chunk", [(300, 10, 16, 32), (257, 3, 4, 64), (1000, 100, 32, 128)]
)
def test_several_chunks(monkeypatch, tokens, num_slots, block_m, chunk):
    """A slot's tokens spread over several sorted chunks keep one token order across them."""
    monkeypatch.setattr(triton_build, "MAX_CHUNK", chunk)
    token_slots = slot_map(tokens, num_slots, 0.2, 0.05, torch.int64, seed=1)
    check(token_slots, num_slots, block_m, torch.randint(1, 65, (num_slots,)))


def test_large_map_several_chunks():
    """T = 9000 > MAX_CHUNK, L = 512: 10 key bits, 5 radix passes."""
    token_slots = slot_map(9000, 512, 0.1, 0.01, torch.int64, seed=3)
    check(token_slots, 512, 64, torch.randint(1, 65, (512,), dtype=torch.int32))


def test_one_slot_many_tiles():
    check(torch.full((500,), 3), 4, 16, torch.tensor([4, 8, 16, 32]))


def test_strided_inputs():
    token_slots = slot_map(200, 9, 0.2, 0.1, torch.int64, seed=5)[::2]
    check(token_slots, 9, 16, torch.randint(1, 65, (18,), dtype=torch.int32)[::2])


def test_slot_map_aliasing_the_output():
    """out.token_slots is the kernel's scratch: a map read from it is copied first."""
    meta = SegmentMeta.empty(40, 5, CPU, block_m=4)
    meta.token_slots.copy_(slot_map(40, 5, 0.2, 0.1, torch.int64, seed=11))
    want = SegmentMeta.empty(40, 5, CPU, block_m=4)
    _build_torch(meta.token_slots.clone(), None, want)
    build_meta_triton(meta.token_slots, None, meta)
    assert_same(meta, want)


def test_long_maps_take_the_torch_build(monkeypatch):
    monkeypatch.setattr(triton_build, "MAX_TOKENS", 50)
    check(slot_map(60, 5, 0.2, 0.1, torch.int64, seed=13), 5, 16)


def test_refill_leaves_nothing_behind():
    """Second build into the same buffers = a fresh build of the second map; sync zeroed."""
    meta = SegmentMeta.empty(60, 6, CPU, block_m=4)
    build_meta_triton(slot_map(60, 6, 0.0, 0.0, torch.int64, seed=7), torch.full((6,), 9), meta)
    meta.sync.fill_(5)
    second = torch.cat([torch.full((50,), -1), torch.arange(10) % 2])
    build_meta_triton(second, None, meta)
    want = SegmentMeta.empty(60, 6, CPU, block_m=4)
    _build_torch(second, None, want)
    assert_same(meta, want)
    assert not meta.sync.any()


def test_build_meta_dispatches_to_triton(triton_backend, monkeypatch):
    calls = []
    monkeypatch.setattr(
        triton_build, "build_meta_triton", lambda *a: calls.append(a) or build_meta_triton(*a)
    )
    token_slots = slot_map(33, 5, 0.2, 0.1, torch.int32, seed=9)
    got = build_meta(token_slots, 5, slot_ranks=torch.arange(1, 6))
    want = SegmentMeta.empty(33, 5, CPU)
    _build_torch(token_slots, torch.arange(1, 6), want)
    assert len(calls) == 1
    assert_same(got, want)
