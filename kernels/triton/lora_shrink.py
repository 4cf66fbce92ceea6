"""Segmented LoRA shrink (Punica SGMV): out[s, t] = scale * A_s[slot_t] @ x[t], one launch.

Grid: (slice group, k-split, tile program). A tile is up to BLOCK_M tokens of one
slot (from SegmentMeta); programs visit only tiles with work. The tile program varies
slowest, so the GPU starts the programs of the tiles with work (they come first)
before those past the device-side tile count, which only read it and exit.
Decode-sized batches put each slice in its own program and split K over H, so enough
programs stream A at full bandwidth (partial sums meet through fp32 atomics in the
zeroed output), but for steps of many adapters with 1-2 tokens each, whose programs
stack all slices' A rows; prefill-sized batches give one program all slices so each x
tile is read once. Rank >= 64 prefill runs the stream-K kernel instead (lora_shrink_stream.py),
but for rank-64 gate_up and qkv in 64-row tiles of steps over 1024 tokens, and qkv in
32-row tiles of 1024-token steps whose expected slots fill them, whose slices' A rows
are stacked here (gate_up into one 128-row operand; qkv q and k into 128 rows and v its
own dot, TAIL). The launch configs are planned in shrink_plan.py. Rows r >= rank
of the slot are masked: a low-rank adapter reads only its rows of A.

Stores mask columns by the pool's rank R, not the slot's: the columns between them hold
exact zeros (their rows of A read as 0), and a mask that is constant over runs of 4
columns lets the compiler issue 4-wide fp32 atomics (a split's partial sums) and stores.
A mask on the loaded per-slot rank made every atomic scalar: 4x the atomic operations.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from kernels.meta import SegmentMeta, expected_tiles, tile_copies, tile_programs
from kernels.triton.common import (
    PDL_MAX_TOKENS,
    PDL_MAX_WIDTH_RATIO,
    PDL_PREFILL_MAX_TOKENS,
    Slices,
    as_meta,
    block_r,
    check_device,
    dot_precision,
    grid_expected,
    pdl_enabled,
    slices_of,
)
from kernels.triton.launch import FastLaunch, plan_cache
from kernels.triton.lora_shrink_stream import launch_stream
from kernels.triton.shrink_plan import (
    ShrinkConfig,
    block_s_for,
    default_config,
    lean_x_for,
    offsets_fit_i32,
    split_k,
    stack_tail_for,
)
from kernels.triton.tiles import (
    load_tile,
    pick,
    shrink_acc,
    shrink_acc_rows,
    stacked_rows,
    store,
    store_slices,
)

__all__ = [
    "CONFIG_OVERRIDE",
    "ShrinkConfig",
    "check_x_a",
    "default_config",
    "lora_shrink_triton",
    "overlaps_expand",
    "shrink_config",
]

CONFIG_OVERRIDE: ShrinkConfig | None = None


@triton.jit
def _shrink_tile(
    x_ptr, a_ptr, out_ptr, tile, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr,
    s0, off_g, off1, off2, k0,
    stride_xt, stride_xh, stride_al, stride_ar, stride_ah, stride_os, stride_ot,
    H, R, k_per_split, scale,
    NSL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, USE_ATOMIC: tl.constexpr, PRECISION: tl.constexpr,
    LEAN_X: tl.constexpr, BLOCK_S: tl.constexpr, TAIL: tl.constexpr,
):  # fmt: skip
    """out[s0 + j, tile tokens, :rank] (+)= scale * x[tok, k-split] @ A_{s0+j}[slot, :rank, k-split]^T, j < NSL.
    BLOCK_S > 0: the NSL slices' rows stacked into one [BLOCK_S]-row operand (s0 = 0);
    TAIL (0 or 1): all but the last slice stacked, the last one its own dot."""
    slot, rank, tok, m_mask = load_tile(
        tile, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, R, BLOCK_M
    )
    if slot >= 0 and BLOCK_S > 0:
        a_base = a_ptr + slot.to(tl.int64) * stride_al
        a_rows, j_mask, j_s, j_r = stacked_rows(
            a_base, off1, off2, rank, stride_ar, NSL - TAIL, BLOCK_R, BLOCK_S
        )
        # TAIL: the last slice (not in the stacked operand) by a second dot per k-step
        offs_r = tl.arange(0, BLOCK_R)
        t_off = off1 if NSL == 2 else off2
        acc, tail = shrink_acc_rows(
            x_ptr, a_rows, tok, m_mask, j_mask, k0, k_per_split, stride_xt, stride_xh,
            stride_ah, H, a_base + t_off + offs_r * stride_ar, offs_r < rank,
            BLOCK_M, BLOCK_S, BLOCK_K, EVEN_K, PRECISION, LEAN_X, TAIL, BLOCK_R,
        )  # fmt: skip
        out_ptrs = out_ptr + j_s[None, :] * stride_os + tok[:, None] * stride_ot + j_r[None, :]
        mask = m_mask[:, None] & ((j_s < NSL - TAIL) & (j_r < R))[None, :]
        store(out_ptrs, acc * scale, mask, USE_ATOMIC)
        if TAIL:
            t_ptrs = out_ptr + (NSL - 1) * stride_os + tok[:, None] * stride_ot + offs_r[None, :]
            store(t_ptrs, tail * scale, m_mask[:, None] & (offs_r < R)[None, :], USE_ATOMIC)
    if slot >= 0 and BLOCK_S == 0:
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        a_slot = a_ptr + slot.to(tl.int64) * stride_al + off_g
        acc0, acc1, acc2 = shrink_acc(
            x_ptr, a_slot, off1, off2, tok, m_mask, r_mask, k0, k_per_split,
            stride_xt, stride_xh, stride_ar, stride_ah, H,
            NSL, BLOCK_M, BLOCK_R, BLOCK_K, EVEN_K, PRECISION, LEAN_X,
        )  # fmt: skip
        out_ptrs = (
            out_ptr + s0.to(tl.int64) * stride_os + tok[:, None] * stride_ot + offs_r[None, :]
        )
        mask = m_mask[:, None] & (offs_r < R)[None, :]  # by R: see the module docstring
        store_slices(out_ptrs, stride_os, acc0, acc1, acc2, scale, mask, NSL, USE_ATOMIC)


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, out_ptr,
    tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, num_tiles_ptr, num_programs,
    a_off1, a_off2,
    stride_xt, stride_xh, stride_al, stride_ar, stride_ah, stride_os, stride_ot,
    H, R, k_per_split, scale,
    NSL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, USE_ATOMIC: tl.constexpr, TILE_COPIES: tl.constexpr,
    DEPENDENTS: tl.constexpr, PRECISION: tl.constexpr, LEAN_X: tl.constexpr,
    BLOCK_S: tl.constexpr, TAIL: tl.constexpr,
):  # fmt: skip
    """Semantics (one program = slice group g, k-split, its tiles):
    for s in group g, t in tile tokens, r < rank[slot]:
        out[s, t, r] (+)= scale * sum_{k in split} A_s[slot, r, k] * x[t, k]
    NSL == 1: group g is slice g. NSL == S: one group, all slices (BLOCK_S > 0: their
    rows of A stacked into one operand, one dot per k-step, or with TAIL all but the
    last slice's, and one more dot for it; else one dot per slice).
    DEPENDENTS: let the next kernel (a programmatic dependent launch) start now.
    """
    if DEPENDENTS:
        gdc_launch_dependents()
    pid_g = tl.program_id(0)
    k0 = tl.program_id(1).to(tl.int64) * k_per_split
    off_g = pick(pid_g, 0, a_off1, a_off2).to(tl.int64)
    off1 = a_off1.to(tl.int64)
    off2 = a_off2.to(tl.int64)
    # Tile j of this program is program_id + j * num_programs. The first needs no tile
    # count (tiles past it have slot -1: no work); the other TILE_COPIES - 1 (when the
    # step has more tiles than programs) are guarded straight copies, not a loop (a loop
    # took ~2x the registers, even unrun). j is a constant: go is True for the first.
    if TILE_COPIES > 1:  # loaded first: waiting for it after the first tile cost each
        num_tiles = tl.load(num_tiles_ptr)  # program an extra round trip at its end
    for j in tl.static_range(TILE_COPIES):
        tile = tl.program_id(2) + j * num_programs
        if j == 0:
            go = True
        else:
            go = tile < num_tiles
        if go:
            _shrink_tile(
                x_ptr, a_ptr, out_ptr, tile, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr,
                pid_g, off_g, off1, off2, k0,
                stride_xt, stride_xh, stride_al, stride_ar, stride_ah, stride_os, stride_ot,
                H, R, k_per_split, scale, NSL, BLOCK_M, BLOCK_R, BLOCK_K, EVEN_K, USE_ATOMIC,
                PRECISION, LEAN_X, BLOCK_S, TAIL,
            )  # fmt: skip


_SHRINK = FastLaunch(_shrink_kernel)


def check_x_a(x: torch.Tensor, lora_a) -> Slices:
    """Refuse an x / lora_a pair the kernels cannot take (ValueError naming the argument)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x: a 2-D tensor [T, H]; got {getattr(x, 'shape', x)!r}")
    check_device(x, "x")
    sl = slices_of(lora_a, "lora_a")
    if any(sh != sl.shapes[0] for sh in sl.shapes) or any(st != sl.strides[0] for st in sl.strides):
        raise ValueError("lora_a: slices differ in shape/strides; all slices must match")
    if sl.base.dtype != x.dtype or sl.base.device != x.device:
        raise ValueError(
            f"lora_a is {sl.base.dtype} on {sl.base.device}; allowed: x's {x.dtype} on {x.device}"
        )
    if sl.shapes[0][2] != x.shape[1]:
        raise ValueError(f"lora_a: H={sl.shapes[0][2]}; x has H={x.shape[1]}")
    return sl


def shrink_config(x: torch.Tensor, sl: Slices, meta: SegmentMeta) -> ShrinkConfig:
    """The launch config of a shrink of x by the slices sl over meta's tiles."""
    return _plan_for(x, sl, meta, False).cfg


def overlaps_expand(
    x: torch.Tensor, lora_a, token_slots_or_meta, out_width: int
) -> tuple[bool, torch.Tensor | SegmentMeta]:
    """(whether the expand of out_width columns after this shrink should be a programmatic
    dependent launch, the step's SegmentMeta): common.PDL_MAX_TOKENS and the prefill rule
    beside it. The meta is built here when given a slot map, for both launches."""
    tokens, hidden = x.shape
    if not pdl_enabled(x.device) or tokens == 0:
        return False, token_slots_or_meta
    if tokens <= PDL_MAX_TOKENS:
        return True, token_slots_or_meta
    if tokens > PDL_PREFILL_MAX_TOKENS or out_width > PDL_MAX_WIDTH_RATIO * hidden:
        return False, token_slots_or_meta
    sl = check_x_a(x, lora_a)
    meta = as_meta(token_slots_or_meta, tokens, sl.shapes[0][0], x.device, sl.shapes[0][1])
    cfg = shrink_config(x, sl, meta)
    return not (cfg.stream_k and meta.block_m < 64), meta


def lora_shrink_triton(
    x: torch.Tensor,
    lora_a: tuple[torch.Tensor, ...],
    token_slots_or_meta: torch.Tensor | SegmentMeta,
    *,
    scale: float = 1.0,
    out: torch.Tensor | None = None,
    dependents: bool = False,
) -> torch.Tensor:
    """x: [T, H] (any strides); lora_a: S x [L, R, H] (dtype of x) -> float32 [S, T, R].

    out: a zeroed contiguous float32 [S, T, R] to write into (checked by kernels.lora_shrink).

    dependents: the next kernel is an expand launched with after_shrink=True; let it
    start while this one runs (where common.pdl_enabled).

    token_slots_or_meta: int [T] slot map, or a SegmentMeta built for (T, L).
    """
    sl = check_x_a(x, lora_a)
    num_slots, rank, hidden = sl.shapes[0]
    tokens, num_slices = x.shape[0], sl.count
    if out is None:
        out = torch.zeros(num_slices, tokens, rank, dtype=torch.float32, device=x.device)
    if tokens == 0:
        return out
    meta = as_meta(token_slots_or_meta, tokens, num_slots, x.device, rank)
    dependents = dependents and pdl_enabled(x.device)
    plan = _plan_for(x, sl, meta, dependents)
    if plan.grid is None:
        launch_stream(x, sl, out, meta, plan.cfg, plan.groups, plan.nsl, plan.br, float(scale),
                      dependents)  # fmt: skip
        return out
    off1, off2 = sl.offsets
    stride_l, stride_r, stride_h = sl.strides[0]
    _SHRINK(
        plan.grid,
        (x, sl.base, out, meta.tile_slot, meta.tile_rank, meta.tile_tok, meta.num_tiles),
        (
            plan.grid[2], off1, off2, x.stride(0), x.stride(1), stride_l, stride_r, stride_h,
            out.stride(0), out.stride(1), hidden, rank, plan.k_per_split, float(scale),
        ),
        plan.constexprs,
        num_warps=plan.cfg.num_warps,
        num_stages=plan.cfg.num_stages,
    )  # fmt: skip
    return out


class _Plan(NamedTuple):
    """A shrink launch's shape, from host values only (`_plan`)."""

    cfg: ShrinkConfig
    groups: int
    nsl: int
    br: int
    grid: tuple[int, int, int] | None
    """None: a stream-K launch (lora_shrink_stream.launch_stream)."""
    k_per_split: int
    constexprs: dict


def _plan_for(x: torch.Tensor, sl: Slices, meta: SegmentMeta, dependents: bool) -> _Plan:
    """`_plan` of this call's host values (CONFIG_OVERRIDE, when set, as the config)."""
    num_slots, rank, hidden = sl.shapes[0]
    return _plan(
        x.shape[0], num_slots, sl.count, rank, hidden, x.dtype, meta.block_m,
        meta.expected_slots, x.device, offsets_fit_i32(x), dependents, CONFIG_OVERRIDE,
    )  # fmt: skip


@plan_cache
def _plan(
    tokens: int, num_slots: int, num_slices: int, rank: int, hidden: int, dtype: torch.dtype,
    bm: int, meta_expected: int | None, device: torch.device, x_fits_i32: bool,
    dependents: bool, override: ShrinkConfig | None,
) -> _Plan:  # fmt: skip
    """The launch of a split-K shrink (or the stream-K choice) for these host values: the
    same for every layer of a group in one step, so a step plans each group once
    (launch_probe.py: planning was about half of an eager layer call's host time)."""
    br = block_r(rank)
    cfg = override or default_config(
        bm, br, dtype.itemsize, num_slices, hidden, tokens, meta_expected
    )
    groups, nsl = (1, num_slices) if cfg.fuse_slices else (num_slices, 1)
    if cfg.stream_k:
        return _Plan(cfg, groups, nsl, br, None, 0, {})
    expected = grid_expected(bm, meta_expected)
    programs = tile_programs(tokens, num_slots, bm, expected)
    # K splits for the tiles expected (ShrinkConfig.split_for_expected), else as for the
    # grid of a step of all L slots
    if cfg.split_for_expected:
        tiles = expected_tiles(tokens, num_slots, bm, expected)
    else:
        tiles = tile_programs(tokens, num_slots, bm)
    bk, k_per_split, split = split_k(cfg, groups, tiles, hidden, br, device)
    constexprs = dict(
        NSL=nsl, BLOCK_M=bm, BLOCK_R=br, BLOCK_K=bk,
        EVEN_K=hidden % k_per_split == 0, USE_ATOMIC=split > 1,
        TILE_COPIES=tile_copies(tokens, num_slots, bm, programs),
        DEPENDENTS=dependents, PRECISION=dot_precision(dtype),
        LEAN_X=lean_x_for(cfg, x_fits_i32), BLOCK_S=block_s_for(cfg, nsl, br),
        TAIL=int(stack_tail_for(cfg, nsl, br)),
    )  # fmt: skip
    return _Plan(cfg, groups, nsl, br, (groups, split, programs), k_per_split, constexprs)
