"""Triton LoRA kernels on CUDA at real widths, against the float64 reference (run with -m gpu)."""

import pytest
import torch

from kernels import SegmentMeta, build_meta, lora_expand, lora_shrink, lora_shrink_expand
from kernels.reference import lora_expand_ref, lora_shrink_ref
from kernels.testing import (
    TOLERANCE,
    captured,
    random_slices,
    random_slots,
    rank_major,
    rel_err,
)
from kernels.triton.common import block_r, pdl_enabled

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LAYERS = {  # name: (H, slice sizes)
    "qkv4096": (4096, (4096, 1024, 1024)),
    "o4096": (4096, (4096,)),
    "gate_up4096": (4096, (14336, 14336)),
    "down14336": (14336, (4096,)),
    "qkv5120": (5120, (5120, 1024, 1024)),
    "o8192": (8192, (8192,)),
}
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
CASES = [  # layer, T, rank, distinct, slots, none_frac, dtype
    ("qkv4096", 1, 16, 1, 8, 0.0, BF16),
    ("qkv4096", 7, 8, 3, 8, 0.3, BF16),
    ("qkv4096", 64, 16, 8, 32, 0.0, BF16),
    ("qkv4096", 256, 64, 32, 64, 0.1, BF16),
    ("qkv4096", 4096, 16, 64, 64, 0.2, BF16),
    ("qkv4096", 2048, 128, 8, 8, 0.0, BF16),
    ("qkv4096", 2048, 64, 8, 16, 0.1, BF16),  # rank 64: q and k stacked, v its own dot
    ("qkv4096", 1100, 64, 3, 8, 0.0, F16),
    ("qkv4096", 1500, 64, 5, 8, 0.2, F32),
    ("qkv4096", 100, 1, 4, 4, 0.0, F16),
    ("qkv4096", 300, 32, 16, 16, 0.5, F32),
    ("o4096", 1, 64, 1, 1, 0.0, F16),
    ("o4096", 1024, 64, 64, 64, 0.0, BF16),
    ("gate_up4096", 16, 16, 8, 8, 0.0, BF16),
    ("gate_up4096", 1024, 128, 4, 8, 0.1, BF16),
    ("gate_up4096", 2048, 64, 8, 16, 0.1, BF16),  # rank-64 pair stacked, 64-row tiles
    ("gate_up4096", 1100, 64, 3, 8, 0.0, F16),
    ("gate_up4096", 1500, 64, 5, 8, 0.2, F32),
    ("down14336", 3, 64, 3, 64, 0.0, BF16),
    ("down14336", 4096, 64, 1, 4, 0.0, BF16),
    ("down14336", 512, 8, 32, 32, 0.2, F32),
    ("qkv5120", 33, 16, 5, 16, 0.2, F16),
    ("o8192", 257, 128, 16, 16, 0.0, BF16),
    ("o8192", 64, 16, 64, 64, 0.0, F32),
]


def _tensors(layer, tokens, rank, distinct, slots, none_frac, dtype):
    hidden, sizes = LAYERS[layer]
    token_slots = random_slots(tokens, slots, distinct, none_frac).cuda()
    x = torch.randn(tokens, hidden, device="cuda").to(dtype)
    lora_a = random_slices(slots, [(rank, hidden)] * len(sizes), dtype, "cuda", hidden**-0.5)
    lora_b = random_slices(slots, [(n, rank) for n in sizes], dtype, "cuda", rank**-0.5)
    return token_slots, x, lora_a, lora_b


def _oracle(x, lora_a, lora_b, y, token_slots, scale, ranks=None):
    """float64 reference on the GPU: (shrink out, expected y)."""
    buf = lora_shrink_ref(
        x.double(), tuple(a.double() for a in lora_a), token_slots, scale=scale, slot_ranks=ranks
    )
    y64 = lora_expand_ref(
        y.double(), buf.double(), tuple(b.double() for b in lora_b), token_slots, slot_ranks=ranks
    )
    return buf, y64


@pytest.mark.parametrize("layer,tokens,rank,distinct,slots,none_frac,dtype", CASES)
def test_matches_reference(layer, tokens, rank, distinct, slots, none_frac, dtype):
    token_slots, x, lora_a, lora_b = _tensors(
        layer, tokens, rank, distinct, slots, none_frac, dtype
    )
    y = torch.randn(tokens, sum(LAYERS[layer][1]), device="cuda").to(dtype)
    want_buf, want_y = _oracle(x, lora_a, lora_b, y, token_slots, 0.5)
    buf = lora_shrink(x, lora_a, token_slots, scale=0.5)
    assert rel_err(buf, want_buf) < TOLERANCE[dtype]
    assert buf[:, token_slots < 0].abs().sum().item() == 0
    before = y.clone()
    lora_expand(y, buf, lora_b, token_slots)
    assert rel_err(y, want_y) < TOLERANCE[dtype]
    assert torch.equal(y[token_slots < 0], before[token_slots < 0])


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_mixed_ranks_overwrite_poisoned_y(dtype):
    token_slots, x, lora_a, lora_b = _tensors("qkv4096", 200, 64, 16, 16, 0.2, dtype)
    ranks = torch.tensor([16, 64] * 8, dtype=torch.int32, device="cuda")
    meta = build_meta(token_slots, 16, slot_ranks=ranks)
    y = torch.full((200, 6144), float("nan"), device="cuda", dtype=dtype)
    want_buf, want_y = _oracle(x, lora_a, lora_b, torch.zeros_like(y), token_slots, 1.0, ranks)
    buf = lora_shrink(x, lora_a, meta)
    assert rel_err(buf, want_buf) < TOLERANCE[dtype]
    lora_expand(y, buf, lora_b, meta, add_inputs=False)
    live = token_slots >= 0
    assert rel_err(y[live], want_y[live]) < TOLERANCE[dtype]
    assert torch.isnan(y[~live]).all()


def test_cuda_graph_replay_with_new_slots():
    """build_meta + shrink + expand captured once; replays follow new slot maps copied in."""
    tokens, slots = 64, 32
    token_slots, x, lora_a, lora_b = _tensors("qkv4096", tokens, 16, 8, slots, 0.2, BF16)
    static_slots = token_slots.clone()
    meta = SegmentMeta.empty(tokens, slots, torch.device("cuda"))
    y0 = torch.randn(tokens, 6144, device="cuda", dtype=BF16)
    y = y0.clone()

    def step():
        build_meta(static_slots, slots, out=meta)
        y.copy_(y0)
        lora_expand(y, lora_shrink(x, lora_a, meta), lora_b, meta)

    graph = captured(step)
    for _ in range(3):
        new = random_slots(tokens, slots, 8, 0.2).cuda()
        static_slots.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(y, _oracle(x, lora_a, lora_b, y0, new, 1.0)[1]) < TOLERANCE[BF16]


def test_offsets_beyond_int32_and_strided_x():
    """Row stride 2**20 (fits int32) times token index 2049 passes 2**31: needs 64-bit offsets."""
    rows, hidden, stride = 2**11 + 2, 4096, 2**20
    storage = torch.empty(stride * (rows - 1) + hidden, device="cuda", dtype=BF16)
    x = storage.as_strided((rows, hidden), (stride, 1))
    x.copy_(torch.randn(rows, hidden, device="cuda"))
    token_slots = random_slots(rows, 4, 4, 0.1).cuda()
    lora_a = random_slices(4, [(16, hidden)], BF16, "cuda", hidden**-0.5)
    lora_b = random_slices(4, [(hidden, 16)], BF16, "cuda", 0.25)
    y = torch.empty_like(storage).as_strided((rows, hidden), (stride, 1))
    y.copy_(torch.randn(rows, hidden, device="cuda"))
    want_buf, want_y = _oracle(x, lora_a, lora_b, y, token_slots, 1.0)
    buf = lora_shrink(x, lora_a, token_slots)
    assert rel_err(buf, want_buf) < TOLERANCE[BF16]
    lora_expand(y, buf, lora_b, token_slots)
    assert rel_err(y, want_y) < TOLERANCE[BF16]


@pytest.mark.parametrize(
    "layer,tokens,rank,distinct,slots,none_frac,dtype",
    [
        ("qkv4096", 1, 16, 1, 8, 0.0, BF16),
        ("qkv4096", 256, 64, 32, 64, 0.1, BF16),
        ("gate_up4096", 64, 16, 8, 8, 0.0, F16),
        ("down14336", 2048, 64, 4, 8, 0.2, BF16),
        ("o4096", 300, 32, 16, 16, 0.5, F32),
    ],
)
def test_shrink_expand_rank_major_b_eager_and_graph(
    layer, tokens, rank, distinct, slots, none_frac, dtype
):
    """The engine's op and layout: B rank-major, shrink output in a zeroed workspace, expand
    a programmatic dependent of the shrink (on an H200); eagerly and in graph replay."""
    token_slots, x, lora_a, lora_b = _tensors(
        layer, tokens, rank, distinct, slots, none_frac, dtype
    )
    lora_b = rank_major(lora_b)
    ranks = torch.randint(1, rank + 1, (slots,), dtype=torch.int32, device="cuda")
    meta = build_meta(token_slots, slots, slot_ranks=ranks)
    y0 = torch.randn(tokens, sum(LAYERS[layer][1]), device="cuda").to(dtype)
    want = _oracle(x, lora_a, lora_b, y0, token_slots, 0.5, ranks)[1]
    ws = torch.zeros(len(lora_a), tokens, rank, device="cuda")
    y = y0.clone()

    def step():
        ws.zero_()
        y.copy_(y0)
        lora_shrink_expand(y, x, lora_a, lora_b, meta, scale=0.5, workspace=ws)

    step()
    assert rel_err(y, want) < TOLERANCE[dtype]
    graph = captured(step)
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(y, want) < TOLERANCE[dtype]
    assert torch.equal(y[token_slots < 0], y0[token_slots < 0])


@pytest.mark.parametrize("copy_x_last", [False, True])
def test_layer_chain_in_one_graph_sees_each_layers_output(copy_x_last):
    """Twelve layers in one graph, each y = 0.5 x (a kernel) then shrink+expand into y, and
    the next layer's x = y: the expand's loads before its wait (y, B) and the next
    shrink's read of y must all see the latest writes (programmatic dependent launch
    must not reorder the chain). copy_x_last: x is copied by a kernel launched just
    before the shrink, which is that shrink's primary (the shrink must wait for it
    before reading x, and the expand's early read of y must still follow the y write
    two kernels back). Checked against a float64 chain on fresh inputs."""
    assert pdl_enabled(torch.device("cuda")) == (torch.cuda.get_device_capability() >= (9, 0))
    layers, tokens, hidden, slots = 12, 64, 4096, 8
    token_slots = random_slots(tokens, slots, 8, 0.1).cuda()
    meta = build_meta(token_slots, slots)
    a = [random_slices(slots, [(16, hidden)], F32, "cuda", hidden**-0.5) for _ in range(layers)]
    b = [rank_major(random_slices(slots, [(hidden, 16)], F32, "cuda", 0.25)) for _ in range(layers)]
    x0 = torch.empty(tokens, hidden, device="cuda")
    ys = [torch.empty(tokens, hidden, device="cuda") for _ in range(layers)]
    xs = [torch.empty(tokens, hidden, device="cuda") for _ in range(layers)]
    ws = torch.zeros(layers, 1, tokens, 16, device="cuda")

    def step():
        ws.zero_()
        x = x0
        for i in range(layers):
            torch.mul(x, 0.5, out=ys[i])
            if copy_x_last:
                x = xs[i].copy_(x)
            lora_shrink_expand(ys[i], x, a[i], b[i], meta, workspace=ws[i])
            x = ys[i]

    x0.normal_()
    graph = captured(step)
    for _ in range(5):
        x0.normal_()
        graph.replay()
        torch.cuda.synchronize()
        want = x0.double()
        for i in range(layers):
            want = _oracle(want, a[i], b[i], 0.5 * want, token_slots, 1.0)[1]
        assert rel_err(ys[-1], want) < 1e-2


@pytest.mark.parametrize(
    "layer,tokens,rank,distinct,dtype,fuse,per_sm,block_k,lean_x",
    [
        ("qkv4096", 4096, 64, 64, BF16, True, 2, 64, True),
        ("qkv4096", 4096, 64, 8, BF16, False, 2, 128, False),
        ("qkv4096", 4096, 16, 8, BF16, False, 4, 128, True),
        ("down14336", 1024, 64, 32, BF16, True, 3, 128, True),
        ("o4096", 64, 16, 8, BF16, False, 8, 128, True),
        ("gate_up4096", 300, 32, 16, F32, True, 1, 32, True),
        ("o8192", 2048, 128, 4, F16, False, 2, 64, False),
    ],
)
def test_stream_k_shrink_matches_reference(
    monkeypatch, layer, tokens, rank, distinct, dtype, fuse, per_sm, block_k, lean_x
):
    """ShrinkConfig.stream_k at real widths: per-slot ranks, slot -1 rows, and a CUDA
    graph replayed on a new slot map (the run boundaries move with the tile count); x
    read with and without the row mask (lean_x)."""
    from kernels.triton import lora_shrink as sh

    cfg = sh.ShrinkConfig(block_k, per_sm, fuse, num_stages=5, stream_k=True, lean_x=lean_x)
    monkeypatch.setattr(sh, "CONFIG_OVERRIDE", cfg)
    token_slots, x, lora_a, _ = _tensors(layer, tokens, rank, distinct, 64, 0.1, dtype)
    _shrink_eager_then_replayed(x, lora_a, token_slots, distinct, rank, dtype)


def _shrink_eager_then_replayed(x, lora_a, token_slots, distinct, rank, dtype, block_m=None):
    """lora_shrink with the config under test against the float64 reference, per-slot
    ranks, slot -1 rows left zero: eagerly, then in a CUDA graph replayed after build_meta
    refilled the same SegmentMeta from a new slot map (fewer adapters, more slot -1)."""
    tokens = x.shape[0]
    a64 = tuple(a.double() for a in lora_a)
    ranks = torch.randint(1, rank + 1, (64,), dtype=torch.int32, device="cuda")
    meta = SegmentMeta.empty(tokens, 64, x.device, block_m=block_m)
    out = torch.zeros(len(lora_a), tokens, rank, device="cuda")

    def step():
        out.zero_()
        lora_shrink(x, lora_a, meta, scale=0.5, out=out)

    for replay in (False, True):
        if replay:
            graph = captured(step)
            token_slots = random_slots(tokens, 64, max(1, distinct // 2), 0.3).cuda()
        build_meta(token_slots, 64, slot_ranks=ranks, out=meta)
        if replay:
            graph.replay()
        else:
            step()
        want = lora_shrink_ref(x.double(), a64, token_slots, scale=0.5, slot_ranks=ranks)
        assert rel_err(out, want) < TOLERANCE[dtype]
        assert out[:, token_slots < 0].abs().sum().item() == 0


@pytest.mark.parametrize(
    "layer,tokens,rank,distinct,dtype,block_m,stack",
    [
        ("qkv4096", 4096, 16, 8, BF16, 64, True),  # 3 x 16 rows stacked into 64 (wgmma)
        ("qkv4096", 1024, 16, 32, BF16, 32, True),
        ("gate_up4096", 2048, 16, 8, F16, 64, True),  # 2 x 16 = 32 rows
        ("qkv4096", 300, 32, 16, F32, 32, True),  # 3 x 32 into 128
        ("qkv5120", 600, 8, 4, BF16, 32, False),  # one dot per slice
    ],
)
def test_fused_slices_split_k_shrink_matches_reference(
    monkeypatch, layer, tokens, rank, distinct, dtype, block_m, stack
):
    """The prefill split-K grid with fused slices (ShrinkConfig.stack_slices on and off) at
    real widths: per-slot ranks, slot -1 rows, K splits through atomics, and a CUDA graph
    replayed on a new slot map."""
    from dataclasses import replace

    from kernels.triton import lora_shrink as sh

    token_slots, x, lora_a, _ = _tensors(layer, tokens, rank, distinct, 64, 0.1, dtype)
    br = block_r(rank)
    base = sh.default_config(block_m, br, x.element_size(), len(lora_a), x.shape[1])
    assert base.fuse_slices and not base.stream_k
    monkeypatch.setattr(sh, "CONFIG_OVERRIDE", replace(base, stack_slices=stack))
    _shrink_eager_then_replayed(x, lora_a, token_slots, distinct, rank, dtype, block_m)


@pytest.mark.parametrize(
    "layer,tokens,rank,distinct,dtype",
    [
        ("qkv4096", 4096, 64, 8, BF16),  # stream-K shrink, 8-warp expand
        ("gate_up4096", 2048, 16, 3, BF16),  # fused-slices split-K shrink
        ("down14336", 1000, 64, 5, F16),  # long K, a partial last tile per slot
    ],
)
def test_128_row_tiles_match_reference(layer, tokens, rank, distinct, dtype):
    """Tiles of 128 rows (never kernels.meta.default_block_m's choice, but SegmentMeta
    takes any power of two) through the default configs, B rank-major, per-slot ranks
    and slot -1 rows."""
    token_slots, x, lora_a, lora_b = _tensors(layer, tokens, rank, distinct, 64, 0.1, dtype)
    lora_b = rank_major(lora_b)
    ranks = torch.randint(1, rank + 1, (64,), dtype=torch.int32, device="cuda")
    meta = build_meta(token_slots, 64, slot_ranks=ranks,
                      out=SegmentMeta.empty(tokens, 64, x.device, block_m=128))  # fmt: skip
    y0 = torch.randn(tokens, sum(LAYERS[layer][1]), device="cuda").to(dtype)
    want_buf, want_y = _oracle(x, lora_a, lora_b, y0, token_slots, 0.5, ranks)
    buf = lora_shrink(x, lora_a, meta, scale=0.5)
    assert rel_err(buf, want_buf) < TOLERANCE[dtype]
    y = y0.clone()
    lora_expand(y, buf, lora_b, meta)
    assert rel_err(y, want_y) < TOLERANCE[dtype]
    assert torch.equal(y[token_slots < 0], y0[token_slots < 0])


@pytest.mark.parametrize("late_add", [False, True])
@pytest.mark.parametrize(
    "layer,tokens,rank,distinct,slots,dtype",
    [
        ("qkv4096", 1, 16, 1, 8, BF16),
        ("qkv4096", 200, 64, 16, 16, BF16),
        ("gate_up4096", 64, 64, 8, 8, F16),
        ("o4096", 1000, 64, 5, 8, BF16),
        ("qkv4096", 4096, 64, 8, 8, BF16),
        ("down14336", 3000, 16, 64, 64, F16),
        ("qkv5120", 33, 128, 5, 16, BF16),
    ],
)
def test_expand_adds_old_y_early_or_late_matching_reference(
    monkeypatch, late_add, layer, tokens, rank, distinct, slots, dtype
):
    """The expand with old y added in the dot's layout or after it (ExpandConfig.late_add,
    which default_config picks by tile shape) on the engine's layout (B rank-major),
    per-slot ranks, slot -1 rows, NaN in the shrink output past each slot's rank (never
    read into y), with and without add_inputs, eagerly and in graph replay after the
    shrink (a programmatic dependent on an H200 for T <= 256)."""
    from dataclasses import replace

    from kernels.triton import lora_expand as ex

    base = ex.default_config
    monkeypatch.setattr(ex, "default_config", lambda *a: replace(base(*a), late_add=late_add))
    token_slots, x, lora_a, lora_b = _tensors(layer, tokens, rank, distinct, slots, 0.2, dtype)
    lora_b = rank_major(lora_b)
    ranks = torch.randint(1, rank + 1, (slots,), dtype=torch.int32, device="cuda")
    meta = build_meta(token_slots, slots, slot_ranks=ranks)
    y0 = torch.randn(tokens, sum(LAYERS[layer][1]), device="cuda").to(dtype)
    want_buf, want = _oracle(x, lora_a, lora_b, y0, token_slots, 0.5, ranks)
    buf = want_buf.float()
    per_tok = torch.where(token_slots >= 0, ranks.long()[token_slots.clamp_min(0)], 0)
    beyond = torch.arange(rank, device="cuda")[None, :] >= per_tok[:, None]
    buf[:, beyond] = float("nan")
    y = y0.clone()
    lora_expand(y, buf, lora_b, meta)
    assert rel_err(y, want) < TOLERANCE[dtype]
    assert torch.equal(y[token_slots < 0], y0[token_slots < 0])
    y.fill_(float("nan"))
    lora_expand(y, buf, lora_b, meta, add_inputs=False)
    live = token_slots >= 0
    delta = _oracle(x, lora_a, lora_b, torch.zeros_like(y0), token_slots, 0.5, ranks)[1]
    assert rel_err(y[live], delta[live]) < TOLERANCE[dtype]
    assert torch.isnan(y[~live]).all()

    ws = torch.zeros(len(lora_a), tokens, rank, device="cuda")

    def step():
        ws.zero_()
        y.copy_(y0)
        lora_shrink_expand(y, x, lora_a, lora_b, meta, scale=0.5, workspace=ws)

    graph = captured(step)
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(y, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("expected", [1, 8, 64])
@pytest.mark.parametrize(
    "layer,tokens,rank,distinct,dtype",
    [
        ("qkv4096", 64, 16, 8, BF16),
        ("gate_up4096", 256, 32, 32, BF16),
        ("down14336", 200, 8, 3, F16),
        ("o4096", 1024, 16, 20, BF16),  # prefill tiles: a grid for all slots
        ("qkv4096", 96, 64, 5, BF16),  # rank 64
        ("o4096", 4096, 64, 40, BF16),  # 64-row tiles (a grid for all slots), stream-K shrink
        # 257-1024 tokens, rank 64: 64-row tiles when expecting >= 64 tokens per slot
        # (expected 1 and 8; kernels.meta.default_block_m), else 32 rows
        ("qkv4096", 768, 64, 6, BF16),  # stream-K shrink (<= 1024 tokens: not stacked)
        ("gate_up4096", 1000, 64, 3, F16),
        # decode, many adapters of 1-2 tokens: expecting 64, all slices stacked in one
        # program (shrink_plan._stacks_decode); fewer expected, per-slice programs
        ("qkv4096", 64, 16, 60, BF16),
        ("gate_up4096", 48, 64, 40, BF16),
    ],
)
def test_expected_slots_size_the_grid_and_keep_every_tile(
    expected, layer, tokens, rank, distinct, dtype
):
    """SegmentMeta.expected_slots below, at and above the batch's distinct slots: shrink +
    expand as the engine runs it (graph replay, the expand a programmatic dependent on an
    H200 for T <= 256), replayed again after the slot map changes to one with other
    adapters; every tile computed, slot -1 rows untouched."""
    slots = 64
    token_slots, x, lora_a, lora_b = _tensors(layer, tokens, rank, distinct, slots, 0.2, dtype)
    lora_b = rank_major(lora_b)
    ranks = torch.randint(1, rank + 1, (slots,), dtype=torch.int32, device="cuda")
    meta = SegmentMeta.empty(tokens, slots, x.device, max_rank=rank, expected_slots=expected)
    live_slots = token_slots.clone()
    y0 = torch.randn(tokens, sum(LAYERS[layer][1]), device="cuda").to(dtype)
    y = torch.empty_like(y0)
    ws = torch.zeros(len(lora_a), tokens, rank, device="cuda")

    def step():
        build_meta(live_slots, slots, ranks, out=meta)
        ws.zero_()
        y.copy_(y0)
        lora_shrink_expand(y, x, lora_a, lora_b, meta, scale=0.5, workspace=ws)

    graph = captured(step)
    for new in (token_slots, random_slots(tokens, slots, distinct, 0.3).cuda()):
        live_slots.copy_(new)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = _oracle(x, lora_a, lora_b, y0, new, 0.5, ranks)[1]
        assert rel_err(y, want) < TOLERANCE[dtype]
        assert torch.equal(y[new < 0], y0[new < 0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sizes", [(4096, 1024, 1024), (14336, 14336), (4096,)])
def test_expand_stacked_on_cuda_equals_float64(dtype, sizes):
    """The stacked layout's expand at real widths: each row's slot columns of the GEMM's
    output, against float64 (the reference's gather then expand)."""
    import kernels
    from kernels.reference import lora_expand_stacked_ref

    tokens, slots_n, rank = 64, 8, 16
    slots = torch.randint(-1, slots_n, (tokens,), device="cuda")
    b = tuple(
        (torch.randn(slots_n, rank, n, device="cuda") * rank**-0.5).to(dtype).transpose(1, 2)
        for n in sizes
    )
    n_base = sum(sizes)
    out = torch.randn(tokens, n_base + len(sizes) * slots_n * rank, device="cuda").to(dtype)
    want = out.double()
    lora_expand_stacked_ref(want, n_base, tuple(t.double() for t in b), slots)
    kernels.lora_expand_stacked(out, n_base, b, build_meta(slots, slots_n))
    got, want = out[:, :n_base].double(), want[:, :n_base]
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert float((got - want).abs().max() / want.abs().max()) < tol
