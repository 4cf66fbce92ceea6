"""Which captured decode graph a step replays (pure logic: no GPU, no capture)."""

import pytest
import torch

from lora_core.context import LoraBatchContext
from replica.cuda_graphs import DecodeGraphs, slot_bucket


@pytest.mark.parametrize(
    "count,limit,want",
    [(1, 64, 1), (2, 64, 2), (3, 64, 4), (5, 64, 8), (17, 64, 32), (33, 64, 64), (64, 64, 64),
     (3, 2, 2), (40, 32, 32), (9, 1 << 30, 16), (20, 24, 24)],
)  # fmt: skip
def test_slot_bucket_rounds_up_to_a_power_of_two_within_the_limit(count, limit, want):
    assert slot_bucket(count, limit) == want


def _ctx(max_rank: int) -> LoraBatchContext:
    return LoraBatchContext(256, "cpu", torch.zeros(8, dtype=torch.int32), max_rank=max_rank)


def _graphs(ctx) -> DecodeGraphs:
    # the key logic only: no model; nothing is captured, so no GPU is needed
    return DecodeGraphs(None, [(torch.zeros(1), torch.zeros(1))], 16, ctx, 0, 128, 64)


def test_key_holds_the_steps_adapters_rounded_to_a_bucket_of_at_most_the_slots():
    """The slot bucket is >= the step's distinct adapters (the graph's tile grids cover
    them all), <= the batch bucket and the pool's L slots, and 0 without adapters."""
    g = _graphs(_ctx(16))
    assert g.key_for(5, 3, 0) == (8, 4, 0)
    assert g.key_for(5, 3, 1) == (8, 4, 1)
    assert g.key_for(5, 3, 3) == (8, 4, 4)
    assert g.key_for(5, 3, 5) == (8, 4, 8)
    assert g.key_for(100, 3, 7) == (128, 4, 8)  # L = 8
    assert g.key_for(2, 1, 2) == (2, 1, 2)  # at most the batch bucket
    for n in range(1, 129):
        for count in range(0, min(n, 8) + 1):
            b, _, slots = g.key_for(n, 1, count)
            assert count <= slots <= min(b, 8)
    assert g.key_for(129, 3, 1) is None  # beyond the largest batch bucket: eager


def test_one_graph_for_any_adapter_count_without_a_lora_context():
    """No LoRA context (the kernels get no expectation): the slot part is min(batch
    bucket, L) for every count, so no graph is captured twice."""
    g = _graphs(None)
    assert {g.key_for(20, 3, c) for c in range(1, 9)} == {(24, 4, 24)}
    assert g.key_for(20, 3, 0) == (24, 4, 0)


def test_rank_64_pools_key_by_slot_bucket_too():
    """The kernels size their decode tile grids by expected_slots at any rank
    (kernels.meta.grid_follows_expected_slots), so a rank-64 pool's decode graphs are
    keyed by the slot bucket as a rank-16 pool's are; prefill-sized steps are not."""
    g = _graphs(_ctx(64))
    assert g.key_for(20, 3, 1) == (24, 4, 1) and g.key_for(20, 3, 5) == (24, 4, 8)
    assert _ctx(64).grid_follows_expected_slots(256)
    assert not _ctx(16).grid_follows_expected_slots(257)  # prefill tiles


@pytest.mark.parametrize("max_tokens", [30, 100])
def test_batch_buckets_never_exceed_the_steps_token_budget(max_tokens):
    """A decode graph of b rows sets b tokens into the LoRA context: with a token budget
    (max_num_batched_tokens) below max_num_seqs, no bucket may pass the budget, or its
    capture raises ValueError from LoraBatchContext.set and fails the step."""
    ctx = LoraBatchContext(max_tokens, "cpu", torch.zeros(8, dtype=torch.int32), max_rank=16)
    g = DecodeGraphs(None, [(torch.zeros(1), torch.zeros(1))], 16, ctx, 0, 128, 64)
    assert g.batch_buckets[-1] == max_tokens
    for n in range(1, max_tokens + 1):
        b, _, _ = g.key_for(n, 1, 1)
        ctx.set(torch.full((b,), 0, dtype=torch.int32), True)  # what capture does
        assert n <= b <= max_tokens
