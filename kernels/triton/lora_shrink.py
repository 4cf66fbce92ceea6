"""Segmented LoRA shrink (Punica SGMV): out[s, t] = scale * A_s[slot_t] @ x[t], one launch.

Grid: (slice group, k-split, tile program). A tile is up to BLOCK_M tokens of one
slot (from SegmentMeta); programs visit only tiles with work. The tile program varies
slowest, so the GPU starts the programs of the tiles with work (they come first)
before those past the device-side tile count, which only read it and exit.
Decode-sized batches put each slice in its own program and split K over H, so enough
programs stream A at full bandwidth (partial sums meet through fp32 atomics in the
zeroed output); prefill-sized batches give one program all slices so each x tile is
read once. Rank >= 64 prefill runs _shrink_stream_kernel instead: a few persistent
programs per SM, each walking an equal run of (tile, k-step) items in one pipelined loop
(stream-K). Rows r >= rank of the slot are masked: a low-rank adapter reads only its
rows of A.

Stores mask columns by the pool's rank R, not the slot's: the columns between them hold
exact zeros (their rows of A read as 0), and a mask that is constant over runs of 4
columns lets the compiler issue 4-wide fp32 atomics (a split's partial sums) and stores.
A mask on the loaded per-slot rank made every atomic scalar: 4x the atomic operations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from kernels.meta import SegmentMeta, expected_tiles, max_tiles, tile_copies, tile_programs
from kernels.triton.common import (
    Slices,
    as_meta,
    block_r,
    cdiv,
    check_device,
    dot_precision,
    expected_slots,
    next_pow2,
    num_sms,
    pdl_enabled,
    slices_of,
)
from kernels.triton.tiles import (
    load_k,
    load_tile,
    pick,
    shrink_acc,
    shrink_acc_rows,
    stacked_rows,
    x_rows,
)

MAX_K_PER_SPLIT = 1024  # longer serial K loops per program left down_proj (H=14336) at half speed
MIN_K_STEPS = 2  # k-steps per program at least, where ShrinkConfig.split_for_expected


@dataclass(frozen=True)
class ShrinkConfig:
    """Launch shape (benchmarks may set CONFIG_OVERRIDE to sweep it)."""

    block_k: int
    """H columns per step; a power of two >= 16."""
    programs_per_sm: int
    """Split K until about this many programs per SM exist."""
    fuse_slices: bool
    """One program computes all slices (x tile read once) instead of one each."""
    num_stages: int = 3
    num_warps: int = 4
    stream_k: bool = False
    """Persistent stream-K launch (_shrink_stream_kernel): programs_per_sm programs per
    SM in all, each walking an equal run of (tile, k-step) items in one pipelined loop,
    instead of one program per (tile bound, k-split)."""
    stack_slices: bool = True
    """With fuse_slices and S > 1: the slices' A rows of the tile's slot are one stacked
    operand (tiles.stacked_rows), so each k-step is ONE dot of the x tile with
    next_pow2(S x BLOCK_R) rows instead of S dots of BLOCK_R rows each. H200
    (results/shrink_probe_h200.json, --ab): qkv r16 T=4096 n=1 in 32-row tiles 17.2 vs
    20.8 us; tune run 14 at n = 8-32: within +-5% either way."""
    max_k_per_split: int = MAX_K_PER_SPLIT
    """K columns one program's serial loop may cover (the split-K grid: more splits when
    one program's share would be longer). A --tune knob (benchmarks/lora_tune.py
    _long_k_configs); the defaults keep MAX_K_PER_SPLIT."""
    split_for_expected: bool = False
    """Size the K splits for the tiles the step is expected to have
    (kernels.meta.expected_tiles with SegmentMeta.expected_slots) instead of for the grid
    of all L slots: about programs_per_sm programs with work per SM at rank 16, scaled by
    16 / BLOCK_R (a rank-64 program streams 4x the bytes of A), the splits a power of
    two, each program at least MIN_K_STEPS k-steps (decode: _split). Not the tile
    programs launched: those include the empty ones that the tile-copy cap adds (tune
    run 23: down r64 T=64 n=1, 17 programs for 5 tiles, shrink 6.5 us with the 16 splits
    they gave, 5.2 with the 56 that 5 tiles give)."""
    k_splits: int = 0
    """K splits of the split-K grid, fixed (a --tune knob: benchmarks/lora_tune.py
    _decode_shrink_configs); 0: from programs_per_sm and max_k_per_split."""
    lean_x: bool = True
    """Read x tiles without a row mask (rows past a tile's tokens read x's row 0; their
    sums land only in rows the store masks) with 32-bit offsets, where every x offset
    fits in int32: about half the address instructions per x element. Tune run 13 on
    the H200: shrinks 0-5% faster (qkv r64 T=4096 n=8 37.7 vs 39.9 us), none slower
    beyond 0.1 us; the kernel grid moved by under 1% (geometric means)."""


CONFIG_OVERRIDE: ShrinkConfig | None = None


@triton.jit
def _store(out_ptrs, acc, mask, USE_ATOMIC: tl.constexpr):
    if USE_ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")
    else:
        tl.store(out_ptrs, acc, mask=mask)


@triton.jit
def _store_slices(out_ptrs, stride_os, acc0, acc1, acc2, scale, mask, NSL: tl.constexpr,
                  USE_ATOMIC: tl.constexpr):  # fmt: skip
    """out[j] (+)= scale * acc_j at out_ptrs + j * stride_os, for the NSL slices j."""
    _store(out_ptrs, acc0 * scale, mask, USE_ATOMIC)
    if NSL > 1:
        _store(out_ptrs + stride_os, acc1 * scale, mask, USE_ATOMIC)
    if NSL > 2:
        _store(out_ptrs + 2 * stride_os, acc2 * scale, mask, USE_ATOMIC)


@triton.jit
def _shrink_tile(
    x_ptr, a_ptr, out_ptr, tile, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr,
    s0, off_g, off1, off2, k0,
    stride_xt, stride_xh, stride_al, stride_ar, stride_ah, stride_os, stride_ot,
    H, R, k_per_split, scale,
    NSL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, USE_ATOMIC: tl.constexpr, PRECISION: tl.constexpr,
    LEAN_X: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """out[s0 + j, tile tokens, :rank] (+)= scale * x[tok, k-split] @ A_{s0+j}[slot, :rank, k-split]^T, j < NSL.
    BLOCK_S > 0: the NSL slices' rows stacked into one [BLOCK_S]-row operand (s0 = 0)."""
    slot, rank, tok, m_mask = load_tile(
        tile, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, R, BLOCK_M
    )
    if slot >= 0 and BLOCK_S > 0:
        a_rows, j_mask, j_s, j_r = stacked_rows(
            a_ptr + slot.to(tl.int64) * stride_al, off1, off2, rank, stride_ar, NSL, BLOCK_R,
            BLOCK_S,
        )  # fmt: skip
        acc = shrink_acc_rows(
            x_ptr, a_rows, tok, m_mask, j_mask, k0, k_per_split, stride_xt, stride_xh,
            stride_ah, H, BLOCK_M, BLOCK_S, BLOCK_K, EVEN_K, PRECISION, LEAN_X,
        )  # fmt: skip
        out_ptrs = out_ptr + j_s[None, :] * stride_os + tok[:, None] * stride_ot + j_r[None, :]
        mask = m_mask[:, None] & ((j_s < NSL) & (j_r < R))[None, :]
        _store(out_ptrs, acc * scale, mask, USE_ATOMIC)
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
        _store_slices(out_ptrs, stride_os, acc0, acc1, acc2, scale, mask, NSL, USE_ATOMIC)


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
    BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Semantics (one program = slice group g, k-split, its tiles):
    for s in group g, t in tile tokens, r < rank[slot]:
        out[s, t, r] (+)= scale * sum_{k in split} A_s[slot, r, k] * x[t, k]
    NSL == 1: group g is slice g. NSL == S: one group, all slices (BLOCK_S > 0: their
    rows of A stacked into one operand, one dot per k-step; else one dot per slice).
    DEPENDENTS: let the next kernel (a programmatic dependent launch) start now.
    """
    if DEPENDENTS:
        gdc_launch_dependents()
    pid_g = tl.program_id(0)
    k0 = tl.program_id(1).to(tl.int64) * k_per_split
    off_g = pick(pid_g, 0, a_off1, a_off2).to(tl.int64)
    off1 = a_off1.to(tl.int64)
    off2 = a_off2.to(tl.int64)
    # The program's first tile needs no tile count: tiles past it have slot -1 (no work).
    # Further tiles (when the step has more than there are programs): TILE_COPIES - 1
    # more straight copies, not a loop (a loop took ~2x the registers, even unrun).
    if TILE_COPIES > 1:  # loaded first: waiting for it after the first tile cost each
        num_tiles = tl.load(num_tiles_ptr)  # program an extra round trip at its end
    _shrink_tile(
        x_ptr, a_ptr, out_ptr, tl.program_id(2), tile_slot_ptr, tile_rank_ptr, tile_tok_ptr,
        pid_g, off_g, off1, off2, k0,
        stride_xt, stride_xh, stride_al, stride_ar, stride_ah, stride_os, stride_ot,
        H, R, k_per_split, scale, NSL, BLOCK_M, BLOCK_R, BLOCK_K, EVEN_K, USE_ATOMIC, PRECISION,
        LEAN_X, BLOCK_S,
    )  # fmt: skip
    if TILE_COPIES > 1:
        for j in tl.static_range(1, TILE_COPIES):
            tile = tl.program_id(2) + j * num_programs
            if tile < num_tiles:
                _shrink_tile(
                    x_ptr, a_ptr, out_ptr, tile, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr,
                    pid_g, off_g, off1, off2, k0,
                    stride_xt, stride_xh, stride_al, stride_ar, stride_ah, stride_os, stride_ot,
                    H, R, k_per_split, scale, NSL, BLOCK_M, BLOCK_R, BLOCK_K, EVEN_K, USE_ATOMIC,
                    PRECISION, LEAN_X, BLOCK_S,
                )  # fmt: skip


@triton.jit
def _shrink_stream_kernel(
    x_ptr, a_ptr, out_ptr,
    tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, num_tiles_ptr,
    a_off1, a_off2,
    stride_xt, stride_xh, stride_al, stride_ar, stride_ah, stride_os, stride_ot,
    H, R, scale,
    NSL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    K_STEPS: tl.constexpr, EVEN_K: tl.constexpr, DEPENDENTS: tl.constexpr, PRECISION: tl.constexpr,
    LEAN_X: tl.constexpr,
):  # fmt: skip
    """Stream-K (one program = slice group g, a run of (tile, k-step) work items): the
    items of the tiles with work, tile-major, K_STEPS per tile, are cut into equal runs,
    one per program along grid axis 1. A program walks its run in ONE loop, which the
    compiler pipelines across tile boundaries (the next tile's first x / A loads are in
    flight while this tile's last ones are used), and adds its sums for each tile it
    touched into out: a plain store where it covered the tile's whole K, else fp32
    atomics (out is zeroed). Semantics as _shrink_kernel's.
    """
    if DEPENDENTS:
        gdc_launch_dependents()
    pid_g = tl.program_id(0)
    total = tl.load(num_tiles_ptr) * K_STEPS
    per = tl.cdiv(total, tl.num_programs(1))
    start = tl.program_id(1) * per
    end = tl.minimum(start + per, total)
    a_g = a_ptr + pick(pid_g, 0, a_off1, a_off2).to(tl.int64)
    off1 = a_off1.to(tl.int64)
    off2 = a_off2.to(tl.int64)
    out_g = out_ptr + pid_g.to(tl.int64) * stride_os
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    acc0 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for i in range(start, end):
        tile = i // K_STEPS  # a constant divisor: a multiply and shift
        kk = i - tile * K_STEPS
        slot, rank, tok, m_mask = load_tile(
            tile, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, R, BLOCK_M
        )
        r_mask = offs_r < rank
        k = kk * BLOCK_K + offs_k
        a_mask = r_mask[:, None]
        if not EVEN_K:
            a_mask = a_mask & (k < H)[None, :]
        x_ptrs = x_rows(x_ptr, tok, k, stride_xt, stride_xh, LEAN_X)
        xv = load_k(x_ptrs, m_mask, 0, k, H, EVEN_K, not LEAN_X)
        a0 = a_g + slot.to(tl.int64) * stride_al + offs_r[:, None] * stride_ar
        a0 += k[None, :] * stride_ah
        acc0 += tl.dot(xv, tl.trans(tl.load(a0, mask=a_mask, other=0.0)), input_precision=PRECISION)
        if NSL > 1:
            acc1 += tl.dot(xv, tl.trans(tl.load(a0 + off1, mask=a_mask, other=0.0)),
                           input_precision=PRECISION)  # fmt: skip
        if NSL > 2:
            acc2 += tl.dot(xv, tl.trans(tl.load(a0 + off2, mask=a_mask, other=0.0)),
                           input_precision=PRECISION)  # fmt: skip
        if (kk == K_STEPS - 1) | (i == end - 1):  # this tile's last item in the run
            out_ptrs = out_g + tok[:, None] * stride_ot + offs_r[None, :]
            mask = m_mask[:, None] & (offs_r < R)[None, :]  # by R: see the module docstring
            if (kk == K_STEPS - 1) & (i - kk >= start):  # the whole K of the tile
                _store_slices(out_ptrs, stride_os, acc0, acc1, acc2, scale, mask, NSL, False)
            else:
                _store_slices(out_ptrs, stride_os, acc0, acc1, acc2, scale, mask, NSL, True)
            acc0 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            acc1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            acc2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)


DECODE_PROGRAMS_PER_SM = 16
"""Decode shrinks (ShrinkConfig.split_for_expected): programs with work per SM at rank 16.
Tune run 22 on the H200 (results/lora_kernels_tune_h200.json, 18 decode shapes, the
shrink alone by its K splits): the best split puts about 1,500-2,000 such programs on
the 132 SMs at rank 16 (qkv r16 T=64: 16 splits with 1 adapter, 8 with 64) and about
400-500 at rank 64. The H200 grid with this rule against the tenth sitting's (shrink +
expand, geometric means): decode rank 16 0.977x (qkv r16 T=64 n=64 22.6 -> 19.8 us,
down r16 T=64 n=32 12.2 -> 11.1), rank 64 1.003x (0.93-1.14x), mixed 0.981x; prefill
(unchanged code) 1.002-1.006x. Tried in the same session and reverted: 16 splits at
every rank and K, halved where more than 24 programs with work per SM would result
(tune run 22's most common best split), 1.014x / 1.018x of the tenth sitting's grid at
rank 16 / 64: one-token steps lost most (down r64 T=1 n=1 5.2 -> 7.5 us with 16 splits
of 7 k-steps; logs/lora_kernels_h200_run_4500222_split16.json)."""

STREAM_SHARED_BYTES = 220_000
"""Shared memory a stream-K launch plans for per SM: its programs must all be resident
(a second wave of persistent programs is a tail)."""


def default_config(
    bm: int, br: int, elem: int, num_slices: int = 3, hidden: int = 4096
) -> ShrinkConfig:
    """Decode (bm 16): per-slice programs of 2 warps, K split for the step's expected tiles
    (ShrinkConfig.split_for_expected, DECODE_PROGRAMS_PER_SM). Tune run 22 against the
    previous rule (K split until ~32 programs per SM at rank 16, ~16 above, over the grid
    for all L slots, 4 warps): qkv r16 T=64 n=64 16.9 -> 13.8 us, n=32 9.5 -> 8.9, n=1
    3.9 -> 3.5; down r16 T=64 n=64 16.4 -> 14.8 (2 warps: 0.85-1.0x of 4 at 8 or more
    splits, 1.1-1.4x at 4). Prefill at rank <= 32: fused slices
    (the S accumulators fit in registers), ~4 per SM; BLOCK_K 128, halved until 3
    pipeline stages of the x and A tiles fit in ~120 KB of shared memory. Prefill at rank
    >= 64: stream-K (stream_config), except long K (H > 8192) in 32-row tiles, which
    takes the fused split-K grid as at rank <= 32.

    From `benchmarks/lora_kernels.py --tune` on the H200 (results/lora_kernels_tune_h200.json):
    over 4 prefill shapes within 1% of the best. Runs 8 and 10: the best stream-K config
    per shape 0.97-1.14x the best split-K one at decode, 0.96-1.09x at rank-16 prefill
    (not used there).
    """
    prefill = bm >= 32
    if prefill and br >= 64 and (bm >= 64 or hidden <= 8192):
        return stream_config(bm, br, elem, hidden)
    fuse = prefill and br <= 64
    rows = bm + (_stacked_rows(num_slices, br) if fuse else br)
    bk = 128
    while bk > 32 and rows * bk * elem * 3 > 120_000:
        bk //= 2
    if not prefill:
        return ShrinkConfig(bk, DECODE_PROGRAMS_PER_SM, False, num_warps=2, split_for_expected=True)
    return ShrinkConfig(block_k=bk, programs_per_sm=4, fuse_slices=fuse)


def stream_config(bm: int, br: int, elem: int, hidden: int) -> ShrinkConfig:
    """Stream-K for prefill at rank >= 64: per-slice programs (fused slices were 1.2-1.6x
    slower: the fat programs that fit one per SM starve the pipeline), 5 stages (3 x / A
    buffers: two items in flight), BLOCK_K 128 and 2 programs per SM, or 64 and 3 per
    SM for long K (H > 8192), fewer where their shared memory does not fit.

    Tune run 8 on the H200 against the split-K grid's best: qkv r64 T=4096 n=8 39.1 vs
    46.0 us, gate_up r64 T=4096 n=8 33.8 vs 36.3, down r64 T=4096 n=32 69.5 vs 81.1,
    qkv r64 T=1024 n=32 28.4 vs 30.3. Not used for long K in 32-row tiles (T <= 1024):
    the grid of 2026-12-03 measured down r64 T=1024 n=1 and n=8 8-13% slower with it.
    """
    bk, per_sm = (64, 3) if hidden > 8192 else (128, 2)
    while bk > 16 and 3 * (bm + br) * bk * elem > STREAM_SHARED_BYTES:
        bk //= 2
    fit = STREAM_SHARED_BYTES // (3 * (bm + br) * bk * elem)
    return ShrinkConfig(bk, max(1, min(per_sm, fit)), False, num_stages=5, stream_k=True)


def _stacked_rows(num_slices: int, br: int) -> int:
    """Rows of A one fused-slices program reads per k-step: the stacked operand's
    (ShrinkConfig.stack_slices), a power of two."""
    return next_pow2(num_slices * br)


def _block_s(cfg: ShrinkConfig, nsl: int, br: int) -> int:
    """The kernel's BLOCK_S: the stacked operand's rows, or 0 (one dot per slice). nsl > 1
    only where cfg.fuse_slices (one program, all slices)."""
    return _stacked_rows(nsl, br) if cfg.stack_slices and nsl > 1 else 0


def offsets_fit_i32(x: torch.Tensor) -> bool:
    """Every element offset into x (2-D, non-negative strides) fits in int32."""
    return sum((n - 1) * st for n, st in zip(x.shape, x.stride(), strict=True)) < 2**31


def _lean_x(cfg: ShrinkConfig, x: torch.Tensor) -> bool:
    """The kernels' LEAN_X: cfg.lean_x where every x offset fits in int32."""
    return cfg.lean_x and offsets_fit_i32(x)


def _block_k(cfg: ShrinkConfig, hidden: int) -> int:
    """cfg.block_k, cut to H's next power of two (at least 16, tl.dot's minimum)."""
    return min(cfg.block_k, max(16, next_pow2(hidden)))


def _split(cfg: ShrinkConfig, groups: int, tiles: int, hidden: int, br: int,
           device: torch.device):  # fmt: skip
    """(BLOCK_K, k_per_split, split) for `tiles` tiles of `groups` slice groups
    (ShrinkConfig.split_for_expected: the tiles the step is expected to have)."""
    bk = _block_k(cfg, hidden)
    steps = cdiv(hidden, bk)
    work = cfg.programs_per_sm * num_sms(device)
    if cfg.split_for_expected:
        want = max(1, work * 16 // br // max(1, tiles * groups))
        want = min(1 << (want.bit_length() - 1), max(1, steps // MIN_K_STEPS))
    else:
        want = max(1, work // max(1, tiles * groups))
    split = min(max(want, cdiv(hidden, cfg.max_k_per_split)), steps)
    if cfg.k_splits:
        split = min(cfg.k_splits, steps)
    k_per_split = cdiv(steps, split) * bk
    return bk, k_per_split, cdiv(hidden, k_per_split)


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
    br, bm = block_r(rank), meta.block_m
    cfg = CONFIG_OVERRIDE or default_config(bm, br, x.element_size(), num_slices, hidden)
    groups, nsl = (1, num_slices) if cfg.fuse_slices else (num_slices, 1)
    dependents = dependents and pdl_enabled(x.device)
    if cfg.stream_k:
        _launch_stream(x, sl, out, meta, cfg, groups, nsl, br, float(scale), dependents)
        return out
    expected = expected_slots(meta)
    programs = tile_programs(tokens, num_slots, bm, expected)
    # K splits for the tiles expected (ShrinkConfig.split_for_expected), else as for the
    # grid of a step of all L slots
    if cfg.split_for_expected:
        tiles = expected_tiles(tokens, num_slots, bm, expected)
    else:
        tiles = tile_programs(tokens, num_slots, bm)
    bk, k_per_split, split = _split(cfg, groups, tiles, hidden, br, x.device)
    off1, off2 = sl.offsets
    stride_l, stride_r, stride_h = sl.strides[0]
    _shrink_kernel[(groups, split, programs)](
        x, sl.base, out,
        meta.tile_slot, meta.tile_rank, meta.tile_tok, meta.num_tiles, programs,
        off1, off2,
        x.stride(0), x.stride(1), stride_l, stride_r, stride_h, out.stride(0), out.stride(1),
        hidden, rank, k_per_split, float(scale),
        NSL=nsl, BLOCK_M=bm, BLOCK_R=br, BLOCK_K=bk,
        EVEN_K=hidden % k_per_split == 0, USE_ATOMIC=split > 1,
        TILE_COPIES=tile_copies(tokens, num_slots, bm, programs),
        DEPENDENTS=dependents, PRECISION=dot_precision(x.dtype),
        LEAN_X=_lean_x(cfg, x), BLOCK_S=_block_s(cfg, nsl, br),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def _launch_stream(x, sl: Slices, out, meta: SegmentMeta, cfg: ShrinkConfig, groups: int,
                   nsl: int, br: int, scale: float, dependents: bool) -> None:  # fmt: skip
    """_shrink_stream_kernel over (groups, programs): programs_per_sm per SM in all, at
    most one per work item of the tile bound."""
    tokens, hidden = x.shape
    num_slots, rank = sl.shapes[0][0], sl.shapes[0][1]
    bk = _block_k(cfg, hidden)
    k_steps = cdiv(hidden, bk)
    items = max_tiles(tokens, num_slots, meta.block_m) * k_steps
    programs = min(items, max(1, cfg.programs_per_sm * num_sms(x.device) // groups))
    off1, off2 = sl.offsets
    stride_l, stride_r, stride_h = sl.strides[0]
    _shrink_stream_kernel[(groups, programs)](
        x, sl.base, out,
        meta.tile_slot, meta.tile_rank, meta.tile_tok, meta.num_tiles,
        off1, off2,
        x.stride(0), x.stride(1), stride_l, stride_r, stride_h, out.stride(0), out.stride(1),
        hidden, rank, scale,
        NSL=nsl, BLOCK_M=meta.block_m, BLOCK_R=br, BLOCK_K=bk, K_STEPS=k_steps,
        EVEN_K=hidden % bk == 0,
        DEPENDENTS=dependents, PRECISION=dot_precision(x.dtype),
        LEAN_X=_lean_x(cfg, x),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
