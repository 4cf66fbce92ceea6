"""kernels.moe_align: the torch alignment's index structures (the worked example, every
local pair once in token order), and the two-launch Triton alignment (interpreted) equal
to it field by field on fresh routings, with its outputs poisoned."""

import pytest
import torch

from kernels.moe_align import align_moe, align_moe_ref, max_blocks
from kernels.testing import random_routing
from kernels.triton.moe_align import align_moe_triton, plan

FIELDS = ("sorted_ids", "block_expert", "num_blocks")


def test_alignment_worked_example():
    """kernels/moe_align.py's docstring example, field by field, on both backends."""
    ids = torch.tensor([[0, 5], [1, 0], [0, 1]])
    for al in (align_moe_ref(ids, 2, 2), align_moe_triton(ids, 2, 2)):
        assert al.sorted_ids.tolist() == [0, 3, 4, 6, 2, 5, 6, 6]
        assert al.block_expert.tolist() == [0, 0, 1, 2]
        assert al.num_blocks.tolist() == [3]


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "block_m"),
    [(1, 2, 8, 16), (7, 2, 4, 4), (33, 3, 5, 8), (64, 2, 2, 16), (50, 1, 16, 4)],
)
def test_alignment_groups_every_local_pair_once(tokens, top_k, experts, block_m):
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(-2, experts + 2, (tokens, top_k), generator=gen)
    pairs = tokens * top_k
    al = align_moe(ids, experts, block_m)
    limit = max_blocks(pairs, experts, block_m)
    assert al.sorted_ids.shape == (limit * block_m,) and al.block_expert.shape == (limit,)
    flat = ids.reshape(-1)
    counts = [int((flat == e).sum()) for e in range(experts)]
    used = sum(-(-c // block_m) for c in counts)
    assert al.num_blocks.tolist() == [used] and used <= limit
    rows = al.sorted_ids.view(limit, block_m)
    for b in range(limit):
        live = rows[b][rows[b] < pairs]
        if b >= used:
            assert al.block_expert[b] == experts and live.numel() == 0
            continue
        e = int(al.block_expert[b])
        assert live.numel() > 0 and (flat[live.long()] == e).all()
        assert torch.equal(live, live.sort().values)  # token order within an expert
    got = al.sorted_ids[al.sorted_ids < pairs].sort().values
    want = ((flat >= 0) & (flat < experts)).nonzero().squeeze(1).int()
    assert torch.equal(got, want)  # each local pair exactly once


def routing(tokens, top_k, experts, kind, seed) -> torch.Tensor:
    """int64 [T, k] fresh ids: "mixed" ~30% off this rank (negative and >= E), "idle"
    about half the experts never chosen, "one" every pair on one expert."""
    torch.manual_seed(seed)
    if kind == "one":
        return torch.full((tokens, top_k), seed % experts)
    skip = range(0, experts, 2) if kind == "idle" and experts > 1 else ()
    return random_routing(tokens, top_k, experts, 0.3 if kind == "mixed" else 0.0, "cpu", skip)[0]


CASES = [  # T, k, E_local, block_m, routing kind, ids (int64, or int32 in a strided view)
    (0, 2, 8, 16, "mixed", "int64"),
    (1, 1, 1, 16, "mixed", "int32 strided"),
    (1, 8, 128, 16, "mixed", "int64"),  # Qwen3-MoE decode
    (1, 2, 8, 16, "one", "int32 strided"),
    (2, 8, 256, 16, "mixed", "int64"),
    (2, 6, 60, 64, "idle", "int32 strided"),
    (7, 2, 8, 16, "mixed", "int64"),  # Mixtral
    (7, 3, 2, 128, "one", "int32 strided"),
    (7, 5, 1, 16, "mixed", "int64"),
    (64, 8, 128, 16, "mixed", "int32 strided"),
    (64, 2, 8, 64, "idle", "int64"),
    (64, 4, 60, 64, "one", "int32 strided"),
    (64, 7, 256, 128, "idle", "int64"),
    (300, 8, 60, 128, "mixed", "int32 strided"),  # 38 chunks, one step each
    (300, 8, 256, 64, "idle", "int64"),  # two 32-pair steps per chunk
    (300, 2, 8, 64, "one", "int32 strided"),
    (300, 1, 2, 16, "mixed", "int64"),
    (300, 3, 128, 128, "mixed", "int32 strided"),
]


def test_cases_reach_every_chunking_and_layout():
    """One chunk and several, several steps per chunk, 16- to 64-pair steps; both id
    layouts."""
    plans = [plan(t * k, e, max_blocks(t * k, e, bm), k) for t, k, e, bm, *_ in CASES if t]
    assert {p.chunks for p in plans} >= {1, 38}
    assert {layout for *_, layout in CASES} == {"int64", "int32 strided"}
    assert any(p.count["C"] > p.count["S"] for p in plans)
    assert {p.count["S"] for p in plans} == {16, 32, 64}


@pytest.mark.parametrize(("tokens", "top_k", "experts", "block_m", "kind", "layout"), CASES)
def test_triton_alignment_equals_torch(poisoned, tokens, top_k, experts, block_m, kind, layout):
    ids = routing(tokens, top_k, experts, kind, seed=tokens * 31 + top_k * 7 + experts)
    if layout != "int64":
        wide = torch.full((tokens, top_k, 2), 3, dtype=torch.int32)
        wide[..., 1] = ids
        ids = wide[..., 1]  # strides (2k, 2)
        assert tokens * top_k < 2 or not ids.is_contiguous()
    want = align_moe_ref(ids, experts, block_m)
    got = align_moe_triton(ids, experts, block_m)
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == torch.int32 and torch.equal(a, b), f"{name}:\n{a}\n!=\n{b}"
    assert got.block_m == block_m


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("experts", [8, 1500])  # 1500 > MAX_EXPERTS: the torch build
def test_either_backend_equals_torch(monkeypatch, backend, experts):
    monkeypatch.setenv("LORAFLEET_KERNELS", backend)
    ids = routing(9, 2, experts, "mixed", seed=experts)
    got, want = align_moe(ids, experts, 16), align_moe_ref(ids, experts, 16)
    assert all(torch.equal(getattr(got, f), getattr(want, f)) for f in FIELDS)


@pytest.mark.parametrize(
    ("ids", "experts", "block_m", "message"),
    [
        (torch.zeros(3, 2), 4, 16, r"topk_ids: torch.float32 \(3, 2\); allowed: int32/int64"),
        (torch.zeros(3, dtype=torch.long), 4, 16, r"topk_ids: .*\(3,\); allowed"),
        (torch.zeros(3, 2, dtype=torch.long), 0, 16, "num_experts 0, block_m 16; allowed"),
        (torch.zeros(3, 2, dtype=torch.long), 4, 0, "block_m 0; allowed: both >= 1"),
    ],
)
def test_bad_arguments_refused(ids, experts, block_m, message):
    with pytest.raises(ValueError, match=message):
        align_moe(ids, experts, block_m)
