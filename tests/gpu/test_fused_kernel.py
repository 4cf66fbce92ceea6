"""The fused one-launch shrink+expand on CUDA at real widths, against the float64 oracle.

Run with -m gpu on the lent H200. Besides the numbers: every flag and counter of the
persistent kernel is back to zero after a launch (the next layer of the step relies
on it), graph replays follow new slot maps, and results are bitwise repeatable.
"""

import pytest
import torch

from kernels import SegmentMeta, build_meta, lora_shrink_expand
from kernels.testing import TOLERANCE, captured, random_slots, rel_err
from tests.gpu.test_kernels import BF16, CASES, F16, F32, LAYERS, _oracle, _tensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(autouse=True)
def fused_path(monkeypatch):
    """lora_shrink_expand takes the fused kernel at every T (off by default)."""
    from kernels.triton import lora_fused

    monkeypatch.setattr(lora_fused, "FUSED_MAX_TOKENS", 1 << 30)


@pytest.mark.parametrize("with_meta", [False, True])
@pytest.mark.parametrize("layer,tokens,rank,distinct,slots,none_frac,dtype", CASES)
def test_matches_oracle(layer, tokens, rank, distinct, slots, none_frac, dtype, with_meta):
    token_slots, x, lora_a, lora_b = _tensors(
        layer, tokens, rank, distinct, slots, none_frac, dtype
    )
    y = torch.randn(tokens, sum(LAYERS[layer][1]), device="cuda").to(dtype)
    before = y.clone()
    _, want = _oracle(x, lora_a, lora_b, y, token_slots, 0.5)
    arg = build_meta(token_slots, slots) if with_meta else token_slots
    assert lora_shrink_expand(y, x, lora_a, lora_b, arg, scale=0.5) is y
    assert rel_err(y, want) < TOLERANCE[dtype]
    assert torch.equal(y[token_slots < 0], before[token_slots < 0])
    if with_meta:
        assert int(arg.sync.abs().sum()) == 0  # flags and program counter reset


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_mixed_ranks_overwrite_poisoned_y(dtype):
    token_slots, x, lora_a, lora_b = _tensors("qkv4096", 200, 64, 16, 16, 0.2, dtype)
    ranks = torch.tensor([16, 64] * 8, dtype=torch.int32, device="cuda")
    meta = build_meta(token_slots, 16, slot_ranks=ranks)
    y = torch.full((200, 6144), float("nan"), device="cuda", dtype=dtype)
    _, want = _oracle(x, lora_a, lora_b, torch.zeros_like(y), token_slots, 1.0, ranks)
    lora_shrink_expand(y, x, lora_a, lora_b, meta, add_inputs=False)
    live = token_slots >= 0
    assert rel_err(y[live], want[live]) < TOLERANCE[dtype]
    assert torch.isnan(y[~live]).all()


def test_bitwise_repeatable():
    """Split-K partial sums are added in a fixed order: the same inputs, the same bits."""
    token_slots, x, lora_a, lora_b = _tensors("down14336", 256, 16, 32, 64, 0.1, BF16)
    meta = build_meta(token_slots, 64)
    y0 = torch.randn(256, 4096, device="cuda", dtype=BF16)
    outs = []
    for _ in range(3):
        y = y0.clone()
        lora_shrink_expand(y, x, lora_a, lora_b, meta)
        outs.append(y)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_graph_replay_many_layers_one_meta():
    """A decode step: build_meta once, then four layer shapes back to back on the same meta
    (each launch relies on the previous one's reset of `sync`), captured once and replayed
    with new slot maps."""
    tokens, slots = 96, 32
    shapes = ["qkv4096", "o4096", "gate_up4096", "down14336"]
    static_slots = random_slots(tokens, slots, 8, 0.2).cuda()
    meta = SegmentMeta.empty(tokens, slots, torch.device("cuda"))
    layers = []
    for name in shapes:
        _, x, lora_a, lora_b = _tensors(name, tokens, 16, 8, slots, 0.0, BF16)
        y0 = torch.randn(tokens, sum(LAYERS[name][1]), device="cuda", dtype=BF16)
        layers.append((x, lora_a, lora_b, y0, y0.clone()))

    def step():
        build_meta(static_slots, slots, out=meta)
        for x, lora_a, lora_b, y0, y in layers:
            y.copy_(y0)
            lora_shrink_expand(y, x, lora_a, lora_b, meta)

    graph = captured(step)
    for _ in range(3):
        new = random_slots(tokens, slots, 12, 0.2).cuda()
        static_slots.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        for x, lora_a, lora_b, y0, y in layers:
            assert rel_err(y, _oracle(x, lora_a, lora_b, y0, new, 1.0)[1]) < TOLERANCE[BF16]
        assert int(meta.sync.abs().sum()) == 0


def test_many_back_to_back_launches():
    """1000 launches on one meta in a row (no sync in between): no lost reset, no hang."""
    token_slots, x, lora_a, lora_b = _tensors("o4096", 64, 16, 8, 16, 0.0, BF16)
    meta = build_meta(token_slots, 16)
    y = torch.zeros(64, 4096, device="cuda", dtype=BF16)
    for _ in range(1000):
        lora_shrink_expand(y, x, lora_a, lora_b, meta, add_inputs=False)
    torch.cuda.synchronize()
    _, want = _oracle(x, lora_a, lora_b, torch.zeros_like(y), token_slots, 1.0)
    assert rel_err(y, want) < TOLERANCE[BF16]
    assert int(meta.sync.abs().sum()) == 0


def test_offsets_beyond_int32_and_strided_x():
    """Row stride 2**20 times token index 2049 passes 2**31: needs 64-bit offsets."""
    rows, hidden, stride = 2**11 + 2, 4096, 2**20
    storage = torch.empty(stride * (rows - 1) + hidden, device="cuda", dtype=BF16)
    x = storage.as_strided((rows, hidden), (stride, 1))
    x.copy_(torch.randn(rows, hidden, device="cuda"))
    token_slots = random_slots(rows, 4, 4, 0.1).cuda()
    _, _, lora_a, lora_b = _tensors("o4096", 1, 16, 1, 4, 0.0, BF16)
    y = torch.empty_like(storage).as_strided((rows, hidden), (stride, 1))
    y.copy_(torch.randn(rows, hidden, device="cuda"))
    _, want = _oracle(x, lora_a, lora_b, y, token_slots, 1.0)
    lora_shrink_expand(y, x, lora_a, lora_b, token_slots)
    assert rel_err(y, want) < TOLERANCE[BF16]
