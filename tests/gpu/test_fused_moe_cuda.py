"""kernels.fused_moe on CUDA at Mixtral-8x7B's layer shapes (H 4096, I 14336, 8 experts,
top-2) and a Qwen3-MoE one (128 experts, top-8) against the float64 oracle, every block
height the launcher picks, expert-parallel ids, skewed routing, a step run in chunks;
the fused path captured in a CUDA graph and replayed on new routings; its Triton
alignment equal to the torch one (eager and replayed in a graph) and its final sum bit
for bit (run with -m gpu)."""

import pytest
import torch

from kernels import fused_moe
from kernels.moe_align import align_moe_ref
from kernels.testing import (
    MOE_TOLERANCE,
    captured,
    oracle_moe,
    random_moe,
    random_routing,
    rel_err,
)
from kernels.triton.fused_moe import moe_config
from kernels.triton.moe_align import align_moe_triton
from kernels.triton.moe_sum import moe_sum

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

H, INTER, E = 4096, 14336, 8
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(scope="module")
def mixtral() -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's experts in bf16 (2.8 GB), drawn once for the module."""
    w13 = torch.empty(E, 2 * INTER, H, dtype=BF16, device="cuda")
    w2 = torch.empty(E, H, INTER, dtype=BF16, device="cuda")
    for e in range(E):
        w13[e] = torch.randn(2 * INTER, H, device="cuda") * H**-0.5
        w2[e] = torch.randn(H, INTER, device="cuda") * INTER**-0.5
    return w13, w2


CASES = [  # T, k, local experts (of the 8), share of ids off this rank
    (1, 2, 8, 0.0),  # decode, 16-row blocks, narrow down tiles
    (7, 2, 8, 0.0),  # 16-row blocks, wide down tiles
    (64, 2, 8, 0.0),
    (128, 2, 8, 0.0),  # 64-row blocks
    (256, 2, 8, 0.0),
    (512, 2, 8, 0.0),  # 128-row blocks
    (16, 1, 8, 0.0),
    (33, 2, 4, 0.5),  # rank 0 of 2: experts 0-3 local
    (200, 2, 2, 0.7),  # rank 0 of 4
]


@pytest.fixture(params=["torch", "triton"])
def prep(request, monkeypatch):
    """The layer over both alignment-and-sum pairs (kernels.backend.moe_prep): the
    default (triton) and the torch one."""
    monkeypatch.setenv("LORAFLEET_MOE_PREP", request.param)
    return request.param


@pytest.mark.parametrize(("tokens", "top_k", "num_local", "off"), CASES)
def test_bf16_mixtral_layer_matches_oracle(mixtral, tokens, top_k, num_local, off, prep):
    w13, w2 = (w[:num_local] for w in mixtral)
    x = torch.randn(tokens, H, device="cuda").to(BF16)
    ids, w = random_routing(tokens, top_k, num_local, off, "cuda")
    out = torch.full((tokens, H), float("nan"), dtype=BF16, device="cuda")
    fused_moe(x, w13, w2, ids, w, out=out)
    assert rel_err(out, oracle_moe(x, w13, w2, ids, w)) < MOE_TOLERANCE[BF16]
    off_rank = ((ids < 0) | (ids >= num_local)).all(1)
    assert out[off_rank].count_nonzero() == 0


def test_a_step_past_the_chunk_runs_in_chunks(mixtral, prep):
    """9000 tokens: passes of 4096, 4096 and 808 (kernels.triton.fused_moe.CHUNK_TOKENS),
    each with its own alignment and tiles, into its rows of out."""
    w13, w2 = mixtral
    x = torch.randn(9000, H, device="cuda").to(BF16)
    ids, w = random_routing(9000, 2, E, 0.1, "cuda")
    out = torch.full((9000, H), float("nan"), dtype=BF16, device="cuda")
    fused_moe(x, w13, w2, ids, w, out=out)
    assert rel_err(out, oracle_moe(x, w13, w2, ids, w)) < MOE_TOLERANCE[BF16]


def test_tile_choices_all_exercised():
    configs = {moe_config(t, k, n) for t, k, n, _ in CASES}
    assert len(configs) == 4 and {c.block_m for c in configs} == {16, 64, 128}


def test_skewed_routing_matches_oracle(mixtral):
    """Every token on experts 3 and 5: several blocks of one expert, six experts idle."""
    w13, w2 = mixtral
    x = torch.randn(512, H, device="cuda").to(BF16)
    ids = torch.tensor([[3, 5]], device="cuda").repeat(512, 1)
    w = torch.rand(512, 2, device="cuda")
    out = fused_moe(x, w13, w2, ids, w)
    assert rel_err(out, oracle_moe(x, w13, w2, ids, w)) < MOE_TOLERANCE[BF16]


@pytest.mark.parametrize(
    ("dtype", "hidden", "inter", "tokens"), [(F16, H, INTER, 64), (F32, 1024, 2048, 100)]
)
def test_other_dtypes_match_oracle(dtype, hidden, inter, tokens):
    x, w13, w2, ids, w = random_moe(tokens, hidden, inter, 8, 2, 0.1, dtype, "cuda", (6,))
    out = fused_moe(x, w13, w2, ids, w)
    assert out.dtype == dtype
    assert rel_err(out, oracle_moe(x, w13, w2, ids, w)) < MOE_TOLERANCE[dtype]


@pytest.mark.parametrize("tokens", [1, 24, 96])
def test_captured_graph_replays_new_routings(mixtral, tokens, prep):
    """One capture, replayed on fresh x / ids / weights copied into its static inputs
    (ids off this rank and idle experts included): each replay equals an eager call bit
    for bit and the oracle within tolerance; a replay whose ids are all another rank's
    gives zeros."""
    w13, w2 = (w[:4] for w in mixtral)
    x = torch.zeros(tokens, H, dtype=BF16, device="cuda")
    ids = torch.zeros(tokens, 2, dtype=torch.long, device="cuda")
    w = torch.zeros(tokens, 2, device="cuda")
    out = torch.empty(tokens, H, dtype=BF16, device="cuda")
    graph = captured(lambda: fused_moe(x, w13, w2, ids, w, out=out))
    for off, skip in ((0.0, ()), (0.4, (1,)), (0.0, (0, 2, 3)), (1.0, ())):
        x.copy_(torch.randn(tokens, H, device="cuda"))
        new_ids, new_w = random_routing(tokens, 2, 4, off, "cuda", skip)
        ids.copy_(new_ids)
        w.copy_(new_w)
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, fused_moe(x, w13, w2, ids, w))
        want = oracle_moe(x, w13, w2, ids, w)
        if off == 1.0:
            assert out.count_nonzero() == 0
        else:
            assert rel_err(out, want) < MOE_TOLERANCE[BF16]


ROUTINGS = [(8, 2), (128, 8)]  # (E, k): Mixtral-8x7B, Qwen3-MoE
FIELDS = ("sorted_ids", "block_expert", "num_blocks")


def assert_same_alignment(got, want):
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == torch.int32 and torch.equal(a, b), f"{name}:\n{a}\n!=\n{b}"


@pytest.mark.parametrize("tokens", [1, 8, 512, 8192])
@pytest.mark.parametrize(("experts", "top_k"), ROUTINGS)
def test_triton_alignment_equals_torch(tokens, experts, top_k):
    """The two-launch alignment equals the torch one field by field at every block height,
    on fresh routings (some ids another rank's, some experts idle, all on one expert),
    int64 and strided int32 ids; T = 8192 at top-8 is 65536 pairs."""
    for off, skip in ((0.0, ()), (0.2, (1, 3)), (0.0, tuple(range(1, experts)))):
        ids, _ = random_routing(tokens, top_k, experts, off, "cuda", skip)
        strided = torch.zeros(tokens, top_k, 2, dtype=torch.int32, device="cuda")
        strided[..., 1] = ids
        for block_m in (16, 64, 128):
            want = align_moe_ref(ids, experts, block_m)
            assert_same_alignment(align_moe_triton(ids, experts, block_m), want)
            assert_same_alignment(align_moe_triton(strided[..., 1], experts, block_m), want)


@pytest.mark.parametrize("tokens", [8, 512])
@pytest.mark.parametrize(("experts", "top_k"), ROUTINGS)
def test_captured_alignment_replays_new_routings(tokens, experts, top_k):
    """One capture of the Triton alignment, replayed on fresh ids copied into its static
    input, its outputs poisoned before each replay: each equals the torch alignment."""
    ids = torch.zeros(tokens, top_k, dtype=torch.long, device="cuda")
    held = {}
    graph = captured(lambda: held.update(al=align_moe_triton(ids, experts, 16)))
    al = held["al"]
    for off, skip in ((0.0, ()), (0.3, (0,)), (0.0, tuple(range(1, experts))), (1.0, ())):
        ids.copy_(random_routing(tokens, top_k, experts, off, "cuda", skip)[0])
        for name in FIELDS:
            getattr(al, name).fill_(-7)
        graph.replay()
        assert_same_alignment(al, align_moe_ref(ids, experts, 16))


@pytest.mark.parametrize(("tokens", "top_k"), [(1, 2), (300, 2), (7, 8), (4096, 8)])
def test_sum_bit_for_bit(tokens, top_k):
    """moe_sum on CUDA (bf16): the fp32 sum over choices 0, 1, ... of the local pairs'
    rows, rounded once, bit for bit; the other rows NaN and unread. At top-2 it is the
    zero-filled torch.sum it replaces, bit for bit."""
    ids, _ = random_routing(tokens, top_k, 4, 0.3, "cuda")
    local = (ids >= 0) & (ids < 4)
    y = torch.randn(tokens, top_k, H, device="cuda").to(BF16)
    y = y.masked_fill(~local[..., None], float("nan"))
    out = torch.full((tokens, H), float("nan"), dtype=BF16, device="cuda")
    moe_sum(y.view(-1, H), ids, 4, out)
    acc = torch.zeros(tokens, H, device="cuda")
    for j in range(top_k):
        acc += torch.where(local[:, j, None], y[:, j].float(), 0.0)
    assert torch.equal(out, acc.to(BF16))
    if top_k == 2:
        assert torch.equal(out, torch.sum(torch.where(local[..., None], y, 0.0), dim=1))


@pytest.mark.parametrize("tokens", [1, 64, 512])
def test_bf16_qwen3_moe_layer_matches_oracle(tokens, prep):
    """A Qwen3-30B-A3B-shaped layer (H 2048, I 768, 128 experts, top-8; 1.2 GB of
    weights), some ids another rank's and some experts idle, against the float64 oracle."""
    x, w13, w2, ids, w = random_moe(tokens, 2048, 768, 128, 8, 0.1, BF16, "cuda", (5, 77))
    out = torch.full((tokens, 2048), float("nan"), dtype=BF16, device="cuda")
    fused_moe(x, w13, w2, ids, w, out=out)
    assert rel_err(out, oracle_moe(x, w13, w2, ids, w)) < MOE_TOLERANCE[BF16]
