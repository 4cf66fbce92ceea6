"""Launch planning of the segmented shrink (kernels/triton/shrink_plan.py): default
configs per tile shape, the K split, 32-bit x offsets. Pure logic, no kernels run."""

import pytest
import torch


@pytest.mark.parametrize("bm", [16, 32, 64])
@pytest.mark.parametrize("br", [16, 32, 64, 128])
@pytest.mark.parametrize("elem,num_slices", [(2, 1), (2, 3), (4, 2), (4, 3)])
@pytest.mark.parametrize("hidden", [4096, 14336])
def test_shrink_default_configs_fit_shared_memory(bm, br, elem, num_slices, hidden):
    """Split-K: 3 pipeline stages of x and A tiles stay within ~120 KB (the H200 allows
    227 KB). Stream-K (prefill, rank >= 64 but for rank-64 gate_up and qkv in 64-row
    tiles): all programs of an SM fit at once."""
    from kernels.triton.shrink_plan import STREAM_SHARED_BYTES, default_config

    cfg = default_config(bm, br, elem, num_slices, hidden)
    stacked = bm == 64 and br == 64 and num_slices in (2, 3)  # gate_up 128 rows, qkv 128 + 64
    assert cfg.stream_k == (bm >= 32 and br >= 64 and (bm == 64 or hidden <= 8192) and not stacked)
    rows = bm + (num_slices if cfg.fuse_slices else 1) * br
    if cfg.stream_k:
        assert not cfg.fuse_slices and cfg.num_stages == 5
        assert cfg.programs_per_sm * 3 * rows * cfg.block_k * elem <= STREAM_SHARED_BYTES
    else:
        assert rows * cfg.block_k * elem * 3 <= 120_000
        assert cfg.fuse_slices == (bm >= 32 and br <= 64)


def test_stacked_operands_pad_or_take_a_tail_slice():
    """Stacked A rows (fused-slices split-K): a power of two of rows per dot. qkv rank 64 in
    64-row tiles stacks q and k (128 rows) and gives v its own dot (ShrinkConfig.stack_tail)
    rather than padding 192 rows to 256; gate_up rank 64 stacks 128 rows with no tail;
    qkv rank 16 keeps one padded 64-row operand (48 rows)."""
    from kernels.triton.shrink_plan import block_s_for, default_config, stack_tail_for

    qkv64 = default_config(64, 64, 2, 3, 4096)
    assert qkv64.fuse_slices and qkv64.stack_tail and not qkv64.stream_k
    assert (block_s_for(qkv64, 3, 64), stack_tail_for(qkv64, 3, 64)) == (128, True)
    gate_up64 = default_config(64, 64, 2, 2, 4096)
    assert (block_s_for(gate_up64, 2, 64), stack_tail_for(gate_up64, 2, 64)) == (128, False)
    qkv16 = default_config(64, 16, 2, 3, 4096)
    assert not qkv16.stack_tail
    assert (block_s_for(qkv16, 3, 16), stack_tail_for(qkv16, 3, 16)) == (64, False)
    assert block_s_for(qkv64, 1, 64) == 0  # per-slice programs: nothing stacked
    assert default_config(32, 64, 2, 3, 4096).stream_k  # 32-row tiles keep stream-K
    # steps of at most 1024 tokens keep stream-K, in 64-row tiles too (few tiles)
    assert default_config(64, 64, 2, 3, 4096, 1024).stream_k
    assert default_config(64, 64, 2, 2, 4096, 1024).stream_k
    assert default_config(64, 64, 2, 3, 4096, 1025).stack_tail


@pytest.mark.parametrize(
    "slices,tokens,expected,stacked",
    [
        (3, 1024, 32, True),  # qkv: every slot fills its 32-row tile
        (3, 1024, 16, True),
        (3, 1024, 33, False),  # a slot of 31 tokens: stream-K (n=64 lost)
        (3, 1024, None, False),  # expected slots unknown
        (3, 768, 16, False),  # under STACK_32_MIN_TOKENS: not measured
        (2, 1024, 32, False),  # gate_up's pair lost in 32-row tiles
    ],
)
def test_qkv_tail_in_32_row_tiles_when_slots_fill_them(slices, tokens, expected, stacked):
    """Rank-64 qkv in 32-row tiles of 1024-token steps stacks q and k with v as a tail
    when the step has >= 32 tokens per expected slot; otherwise stream-K as before."""
    from kernels.triton.shrink_plan import default_config

    cfg = default_config(32, 64, 2, slices, 4096, tokens, expected)
    assert cfg.stream_k != stacked
    assert cfg.stack_tail == stacked and cfg.fuse_slices == stacked
    if stacked:  # 32 + 192 rows of x and A per k-step, 3 stages in ~120 KB
        assert cfg.block_k == 64


@pytest.mark.parametrize(
    "slices,br,tokens,expected,stacked",
    [
        (3, 16, 64, 64, True),  # qkv r16: one token per slot
        (3, 16, 64, 32, True),  # two tokens per slot
        (2, 16, 64, 64, True),  # gate_up
        (3, 64, 64, 32, True),  # rank 64: 4 warps
        (3, 16, 65, 32, False),  # over 2 tokens per slot
        (3, 16, 256, 64, False),  # 4 tokens per slot: even in run 27
        (3, 64, 1, 1, False),  # few adapters: per-slice programs (lost 6.4 vs 5.1 us)
        (3, 16, 16, 8, False),
        (3, 16, 64, None, False),  # expected slots unknown
        (1, 16, 64, 64, False),  # one slice: nothing to stack
    ],
)
def test_decode_stacks_slices_for_many_adapters_of_few_tokens(
    slices, br, tokens, expected, stacked
):
    """Decode shrinks of multi-slice layers stack all slices in one program when the step
    has >= 32 expected slots of <= 2 tokens each (shrink_plan._stacks_decode); otherwise
    per-slice programs."""
    from kernels.triton.shrink_plan import block_s_for, default_config, stack_tail_for

    cfg = default_config(16, br, 2, slices, 4096, tokens, expected)
    assert cfg.split_for_expected and cfg.fuse_slices == stacked and cfg.stack_tail == stacked
    if stacked:
        assert cfg.block_k == 128 and cfg.num_warps == (2 if br == 16 else 4)
        tail = slices == 3
        assert stack_tail_for(cfg, slices, br) == tail
        assert block_s_for(cfg, slices, br) == (2 * br if tail else slices * br)
    else:
        assert cfg.num_warps == 2


@pytest.mark.parametrize(
    "tokens,hidden,width,rank,expected,pdl",
    [
        (1, 4096, 28672, 16, 1, True),  # decode: every layer
        (256, 4096, 28672, 64, 64, True),
        (1024, 4096, 6144, 16, 8, True),  # qkv r16 prefill (split-K)
        (1024, 14336, 4096, 64, 32, True),  # down r64 32-row tiles: split-K (long K)
        (1024, 4096, 4096, 64, 1, True),  # o r64, 64-row tiles (stream-K)
        (1024, 4096, 4096, 64, 32, False),  # o r64, 32-row tiles: stream-K
        (1024, 4096, 28672, 16, 8, False),  # gate_up: wide expand
        (1025, 4096, 6144, 16, 8, False),  # over PDL_PREFILL_MAX_TOKENS
    ],
)
def test_expand_overlaps_shrink_where_measured_faster(
    monkeypatch, tokens, hidden, width, rank, expected, pdl
):
    """lora_shrink.overlaps_expand: programmatic dependent launch of the expand for decode
    steps, and for prefill steps up to PDL_PREFILL_MAX_TOKENS unless the expand is wide
    (gate_up) or the shrink is stream-K in 32-row tiles (pdl_enabled stubbed: the CPU
    has no PDL; no kernel runs)."""
    from kernels.meta import SegmentMeta
    from kernels.triton import lora_shrink as sh

    monkeypatch.setattr(sh, "pdl_enabled", lambda device: True)
    x = torch.empty(tokens, hidden, dtype=torch.bfloat16)
    a = (torch.empty(64, rank, hidden, dtype=torch.bfloat16),)
    meta = SegmentMeta.empty(tokens, 64, x.device, max_rank=rank, expected_slots=expected)
    got, meta_out = sh.overlaps_expand(x, a, meta, width)
    assert got == pdl and meta_out is meta


def test_decode_shrink_splits_k_for_the_expected_tiles(monkeypatch):
    """Decode shrinks size their K splits for the tiles the step is expected to have
    (ShrinkConfig.split_for_expected): ~16 programs with work per SM at rank 16, a quarter
    at rank 64, a power of two, >= 2 k-steps each, >= H / MAX_K_PER_SPLIT (figures for
    the H200's 132 SMs: tune run 22's best splits)."""
    from kernels.triton import shrink_plan as sh

    monkeypatch.setattr(sh, "num_sms", lambda device: 132)
    cfg = sh.default_config(16, 16, 2, 3, 4096)
    assert cfg.split_for_expected and cfg.num_warps == 2 and cfg.block_k == 128
    assert not sh.default_config(32, 16, 2, 3, 4096).split_for_expected
    cpu = torch.device("cpu")
    # qkv r16 T=64: 64 adapters (68 tiles, 3 slice groups) -> 8; 1 adapter (5) -> 16
    assert sh.split_k(cfg, 3, 68, 4096, 16, cpu) == (128, 512, 8)
    assert sh.split_k(cfg, 3, 5, 4096, 16, cpu) == (128, 256, 16)  # 2 k-steps each
    assert sh.split_k(cfg, 3, 36, 4096, 64, cpu)[2] == 4  # qkv r64 T=64 n=32
    assert sh.split_k(cfg, 1, 36, 4096, 64, cpu)[2] == 8  # o r64 T=64 n=32
    assert sh.split_k(cfg, 1, 24, 14336, 64, cpu)[2] == 16  # down r64 T=256 n=8
    assert sh.split_k(cfg, 1, 68, 14336, 64, cpu)[2] == 14  # >= H / MAX_K_PER_SPLIT
    assert sh.split_k(cfg, 1, 5, 14336, 64, cpu)[2] == 56  # down r64 T=64 n=1: 2 k-steps


def test_x_offsets_fit_int32_rule():
    """The host's choice of 32-bit x offsets (LEAN_X): the largest element offset, by the
    tensor's strides, must stay below 2**31."""
    from kernels.triton.shrink_plan import offsets_fit_i32

    assert offsets_fit_i32(torch.empty(4096, 14336, device="meta"))
    assert offsets_fit_i32(torch.empty(2**31 // 4096, 4096, device="meta"))  # last offset 2**31-1
    assert not offsets_fit_i32(torch.empty(2**31 // 4096 + 1, 4096, device="meta"))
    wide = torch.empty(2049, 2**20, device="meta")[:, :4096]  # row stride 2**20, 2049 rows
    assert not offsets_fit_i32(wide)
    assert offsets_fit_i32(torch.empty(4096, 2048, device="meta").t())  # column-major
