"""The Triton build of SegmentMeta on CUDA equals the torch build, also under CUDA-graph replay."""

import dataclasses

import pytest
import torch

from kernels.meta import SegmentMeta, _build_torch, build_meta, default_block_m
from kernels.testing import captured, slot_map
from kernels.triton.build_meta import build_meta_triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")


def torch_build(token_slots, num_slots, block_m, slot_ranks):
    meta = SegmentMeta.empty(token_slots.shape[0], num_slots, CUDA, block_m=block_m)
    _build_torch(token_slots, slot_ranks, meta)
    return meta


def assert_same(got: SegmentMeta, want: SegmentMeta):
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), f.name
        else:
            assert a == b, f.name


def junk(meta: SegmentMeta) -> SegmentMeta:
    for f in dataclasses.fields(meta):
        value = getattr(meta, f.name)
        if isinstance(value, torch.Tensor):
            value.fill_(7)
    return meta


@pytest.mark.parametrize("num_slots", [1, 8, 64, 100, 512])
@pytest.mark.parametrize("tokens", [1, 7, 64, 256, 1000, 4096, 8192])
def test_matches_torch_build(tokens, num_slots):
    """Both tile sizes a step can get (decode 16, prefill 32/64), with and without ranks."""
    for i, block_m in enumerate(sorted({16, default_block_m(tokens), 64})):
        dtype = (torch.int64, torch.int32)[i % 2]
        token_slots = slot_map(tokens, num_slots, 0.15, 0.02, dtype, seed=tokens + i, device=CUDA)
        ranks = torch.randint(1, 129, (num_slots,), device=CUDA) if i % 2 == 0 else None
        got = junk(SegmentMeta.empty(tokens, num_slots, CUDA, block_m=block_m))
        build_meta_triton(token_slots, ranks, got)
        assert_same(got, torch_build(token_slots, num_slots, block_m, ranks))


@pytest.mark.parametrize("tokens,num_slots", [(256, 64), (4096, 128)])
def test_one_slot_and_no_slot(tokens, num_slots):
    """Every token in one slot (longest run), then none in any."""
    for fill in (num_slots - 1, -1):
        token_slots = torch.full((tokens,), fill, device=CUDA)
        got = junk(SegmentMeta.empty(tokens, num_slots, CUDA))
        build_meta_triton(token_slots, None, got)
        assert_same(got, torch_build(token_slots, num_slots, got.block_m, None))


@pytest.mark.parametrize("tokens,num_slots", [(64, 32), (4096, 100)])
def test_cuda_graph_replay(tokens, num_slots):
    """build_meta captured once into preallocated buffers; each replay follows the slot map
    and ranks copied into the static inputs."""
    static_slots = slot_map(tokens, num_slots, 0.2, 0.0, torch.int64, seed=0, device=CUDA)
    static_ranks = torch.randint(1, 129, (num_slots,), device=CUDA, dtype=torch.int32)
    meta = SegmentMeta.empty(tokens, num_slots, CUDA)
    graph = captured(lambda: build_meta(static_slots, num_slots, slot_ranks=static_ranks, out=meta))
    for seed in range(1, 4):
        new = slot_map(tokens, num_slots, 0.1 * seed, 0.01, torch.int64, seed=seed, device=CUDA)
        static_slots.copy_(new)
        static_ranks.copy_(torch.randint(1, 129, (num_slots,), device=CUDA))
        meta.sync.fill_(3)
        graph.replay()
        torch.cuda.synchronize()
        assert_same(meta, torch_build(new, num_slots, meta.block_m, static_ranks))
