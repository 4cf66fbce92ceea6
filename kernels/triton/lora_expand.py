"""Segmented LoRA expand (Punica SGMV): y[t, off_s:off_s+N_s] (+)= B_s[slot_t] @ buf[s, t], one launch.

Grid: (column group over all slices, tile program); programs stride over the valid
tiles. The tile program varies slowest, so the programs of the tiles with work (they
come first) start before those past the device-side tile count. A column group is
n_iters blocks of BLOCK_N columns of one slice; the groups of slices with unequal N
are laid end to end, so q, k and v (or gate and up) share one launch. Each (tile,
column) is written by exactly one program: no atomics, rows of slot -1 are never
touched. Columns r >= rank of the slot are masked, so only the slot's own rank is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kernels.meta import SegmentMeta, tile_copies, tile_programs
from kernels.triton.common import (
    MAX_SLICES,
    Slices,
    as_meta,
    block_r,
    cdiv,
    check_device,
    dot_precision,
    grid_expected,
    launch_pdl,
    pdl_enabled,
    per_slice_strides,
    slices_of,
)
from kernels.triton.launch import FastLaunch, plan_cache
from kernels.triton.tiles import expand_operands, expand_store, load_tile, pick


@triton.jit
def _expand_tile(
    y_ptr, buf_ptr, b_slice, tile, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr,
    s, col0, offs_n, n_s, stride_bl, stride_bn, stride_br,
    stride_yt, stride_yn, stride_bs, stride_bt, stride_bk, stride_bslot, R,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    N_ITERS: tl.constexpr, ADD_INPUTS: tl.constexpr, WAIT: tl.constexpr,
    PRECISION: tl.constexpr, LATE_ADD: tl.constexpr,
):  # fmt: skip
    """y[tile tokens, col0 + n] (+)= buf[s, tok, :rank] @ B_s[slot, n, :rank]^T for the
    N_ITERS column blocks of BLOCK_N from offs_n on (columns < n_s).

    The first block is peeled: with WAIT (launched as a programmatic dependent of the
    shrink that writes buf) its tile, B and old y, which the shrink does not write, are
    loaded before waiting for it. buf is read once for all blocks; the later blocks form
    a loop the compiler can pipeline (num_stages > 1).
    """
    slot, rank, tok, m_mask = load_tile(
        tile, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, R, BLOCK_M
    )
    if slot >= 0:
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        b_slot = b_slice + slot.to(tl.int64) * stride_bl
        y_ptrs, mask, y_old, b = expand_operands(
            y_ptr, b_slot, tok, m_mask, r_mask, col0, offs_n, offs_n < n_s,
            stride_bn, stride_br, stride_yt, stride_yn, BLOCK_R, ADD_INPUTS,
        )  # fmt: skip
        if WAIT:
            gdc_wait()
        buf_ptrs = (
            buf_ptr
            + s.to(tl.int64) * stride_bs
            + slot.to(tl.int64) * stride_bslot
            + tok[:, None] * stride_bt
            + offs_r[None, :] * stride_bk
        )
        h = tl.load(buf_ptrs, mask=m_mask[:, None] & r_mask[None, :], other=0.0).to(b.dtype)
        expand_store(y_ptrs, mask, y_old, b, h, ADD_INPUTS, PRECISION, LATE_ADD)
        for j in range(1, N_ITERS):
            offs_j = offs_n + j * BLOCK_N
            y_ptrs, mask, y_old, b = expand_operands(
                y_ptr, b_slot, tok, m_mask, r_mask, col0, offs_j, offs_j < n_s,
                stride_bn, stride_br, stride_yt, stride_yn, BLOCK_R, ADD_INPUTS,
            )  # fmt: skip
            expand_store(y_ptrs, mask, y_old, b, h, ADD_INPUTS, PRECISION, LATE_ADD)


@triton.jit
def _expand_kernel(
    y_ptr, buf_ptr, b_ptr,
    tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, num_tiles_ptr, num_programs,
    b_off1, b_off2, stride_bl0, stride_bl1, stride_bl2, stride_bn0, stride_bn1, stride_bn2,
    stride_br0, stride_br1, stride_br2,
    n0, n1, n2, nt1, nt2,
    stride_yt, stride_yn, stride_bs, stride_bt, stride_bk, stride_bslot,
    R,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    N_ITERS: tl.constexpr, ADD_INPUTS: tl.constexpr, TILE_COPIES: tl.constexpr,
    WAIT: tl.constexpr, PRECISION: tl.constexpr, LATE_ADD: tl.constexpr,
):  # fmt: skip
    """Semantics (one program = column group j of slice s, its tiles; a group is N_ITERS
    blocks of BLOCK_N columns of one slice, groups of slices 1 and 2 start at nt1, nt2):
    for t in tile tokens, n in group j: y[t, off_s + n] = (y[t, off_s + n] if ADD_INPUTS else 0)
                                          + sum_{r < rank[slot]} B_s[slot, n, r] * buf[s, t, r]
    (buf[s, t, r] at buf_ptr + s * stride_bs + slot * stride_bslot + t * stride_bt + r *
    stride_bk: stride_bslot 0 reads the shrink's workspace, R the stacked layout's GEMM
    columns, `lora_expand_stacked_triton`)
    """
    pid_n = tl.program_id(0)
    s = (pid_n >= nt1).to(tl.int32) + (pid_n >= nt2).to(tl.int32)
    n_s = pick(s, n0, n1, n2)
    col0 = pick(s, 0, n0, n0 + n1).to(tl.int64)
    offs_n = (pid_n - pick(s, 0, nt1, nt2)) * (N_ITERS * BLOCK_N) + tl.arange(0, BLOCK_N)
    b_slice = b_ptr + pick(s, 0, b_off1, b_off2).to(tl.int64)
    stride_bl = pick(s, stride_bl0, stride_bl1, stride_bl2).to(tl.int64)
    stride_bn = pick(s, stride_bn0, stride_bn1, stride_bn2)
    stride_br = pick(s, stride_br0, stride_br1, stride_br2)
    # Tile j of this program is program_id + j * num_programs. The first needs no tile
    # count (tiles past it have slot -1: no work); the other TILE_COPIES - 1 (when the
    # step has more tiles than programs) are guarded straight copies, not a loop (a loop
    # took ~1.5x the registers, even unrun). j is a constant: go is True for the first.
    if TILE_COPIES > 1:  # loaded first: waiting for it after the first tile cost each
        num_tiles = tl.load(num_tiles_ptr)  # program an extra round trip at its end
    for j in tl.static_range(TILE_COPIES):
        tile = tl.program_id(1) + j * num_programs
        if j == 0:
            go = True
        else:
            go = tile < num_tiles
        if go:
            _expand_tile(
                y_ptr, buf_ptr, b_slice, tile, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr,
                s, col0, offs_n, n_s, stride_bl, stride_bn, stride_br,
                stride_yt, stride_yn, stride_bs, stride_bt, stride_bk, stride_bslot, R,
                BLOCK_M, BLOCK_N, BLOCK_R, N_ITERS, ADD_INPUTS, WAIT, PRECISION, LATE_ADD,
            )  # fmt: skip
    if WAIT:  # also programs without work: this kernel ends only after the shrink has
        gdc_wait()


@dataclass(frozen=True)
class ExpandConfig:
    """Launch shape (benchmarks may set CONFIG_OVERRIDE to sweep it)."""

    block_n: int
    """Output columns per block; a power of two >= 16."""
    num_warps: int = 4
    n_iters: int = 1
    """Blocks of block_n columns (of one slice) per program: the shrink output is read
    once for all of them, and blocks after the first are a loop that num_stages > 1
    pipelines."""
    num_stages: int = 1
    late_add: bool = False
    """Round h @ B to y's dtype and add old y in the layout y was loaded in
    (tiles.expand_store LATE_ADD): one shared-memory layout change per block instead of
    two (Triton 3.9's sm_90 build of a 16 x 256 rank-64 decode tile: 131 vs 138 registers,
    7 vs 11 barriers). default_config picks it by tile shape."""


CONFIG_OVERRIDE: ExpandConfig | None = None
_EXPAND = FastLaunch(_expand_kernel)


def default_config(bm: int, br: int, max_n: int) -> ExpandConfig:
    """From `benchmarks/lora_kernels.py --tune` and the grid on the H200 (B rank-major;
    results/lora_kernels_tune_h200.json, lora_kernels_h200.json). 128 columns per block:
      - rank > 64: 64 columns (registers);
      - decode-sized tiles (bm 16): one block per program, 4 warps; wide slices (gate_up,
        N >= 8192) take 256 columns (gate_up r16 T=64: 8.4 vs 11.4 us). Two blocks per
        program made rank-64 decode shrink+expand 4% slower (geometric mean of 52 grid
        rows, up to 15%): the second block's loads come after the wait for the shrink;
      - prefill tiles of 64 rows at rank <= 32: 8 warps (gate_up r16 T=4096: 145 vs 150 us);
      - other prefill tiles (rank 64, or 32-row tiles at T <= 1024): two blocks per
        program, pipelined, 4 warps. The shrink rows are read once for both and the second
        block's loads overlap the first's: expand 8% (rank 64, T=1024) and 5% (rank 64,
        T >= 2048; gate_up r64 T=4096 160 vs 172 us) and 6% (rank 16, T=1024) faster,
        geometric means over the grid.
    late_add at decode (16-row tiles) except rank-16 wide slices (gate_up): the grid of
    2026-12-03 (eighth sitting) against the seventh's, whose code differed only there:
    shrink + expand 0.983x and the expand alone 0.954x in geometric mean over those 85
    rows (0.94-1.003x; o r16 T=64 n=64 12.5 -> 11.9 us), rows left as they were
    0.998-1.001x. Left off where it was slower or even:
      - 32-row tiles at rank 64 (T = 257-1024): 1.009x in the same grid (0.95-1.10x;
        gate_up r64 T=1024 n=32 96.2 -> 99.1 us), though tune run 19 had 0.97-0.98x;
      - 64-row tiles (Hopper's wgmma): 1.13-1.15x in tune run 19 (gate_up r64 T=4096
        n=8 188.5 vs 163.6 us);
      - gate_up r16 at decode (run 19: 1.02x alone, 1.12x with the shrink), rank-16
        prefill (0.89-1.035x, even in geometric mean), rank 128 (not measured).
    """
    if br > 64:
        return ExpandConfig(block_n=64)
    if bm >= 128:  # a caller's 128-row tiles (default_block_m never picks them): 4 warps spill
        return ExpandConfig(block_n=128, num_warps=8, n_iters=2, num_stages=2)
    if bm <= 16:  # late_add: br is 16, 32 or 64 here
        return ExpandConfig(
            block_n=256 if max_n >= 8192 else 128, late_add=br >= 32 or max_n < 8192
        )
    if br <= 32 and bm >= 64:
        return ExpandConfig(block_n=128, num_warps=8)
    return ExpandConfig(block_n=128, n_iters=2, num_stages=2)


def check_y_b(y: torch.Tensor, lora_b) -> Slices:
    """Refuse a y / lora_b pair the kernels cannot take (ValueError naming the argument)."""
    if not isinstance(y, torch.Tensor) or y.dim() != 2:
        raise ValueError(f"y: a 2-D tensor [T, sum N_s]; got {getattr(y, 'shape', y)!r}")
    check_device(y, "y")
    sl = slices_of(lora_b, "lora_b")
    rank = sl.shapes[0][2]
    if any(sh[2] != rank for sh in sl.shapes):
        raise ValueError("lora_b: slices differ in rank; all slices must match")
    if sl.base.device != y.device:
        raise ValueError(f"lora_b is on {sl.base.device}; allowed: y's device {y.device}")
    width = sum(sh[1] for sh in sl.shapes)
    if y.shape[1] != width or y.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"y: {y.dtype} [.., {y.shape[1]}]; allowed: fp16/bf16/fp32 [T, {width}]")
    return sl


def _check(y: torch.Tensor, buf: torch.Tensor, lora_b) -> Slices:
    sl = check_y_b(y, lora_b)
    want = (sl.count, y.shape[0], sl.shapes[0][2])
    if not isinstance(buf, torch.Tensor) or tuple(buf.shape) != want or buf.device != y.device:
        raise ValueError(
            f"buf: shape {tuple(getattr(buf, 'shape', ()))}; allowed: {list(want)} on {y.device}"
        )
    return sl


def lora_expand_triton(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: tuple[torch.Tensor, ...],
    token_slots_or_meta: torch.Tensor | SegmentMeta,
    *,
    add_inputs: bool = True,
    after_shrink: bool = False,
) -> torch.Tensor:
    """y: [T, sum N_s] (in place, any strides); buf: [S, T, R] (fp32 from shrink); lora_b: S x [L, N_s, R].

    token_slots_or_meta: int [T] slot map, or a SegmentMeta built for (T, L). Returns y.

    after_shrink: the kernel launched just before on this stream is the shrink that
    writes buf, launched with `dependents=True`, and was itself launched normally (so
    whatever wrote y, B and the metadata had finished before it began). Where the GPU
    allows (common.pdl_enabled), this launch then overlaps the shrink's tail: programmatic
    dependent launch, loading its tile, B and old y before waiting for the shrink.
    """
    sl = _check(y, buf, lora_b)
    strides = (buf.stride(0), buf.stride(1), buf.stride(2), 0)
    _launch(y, buf, sl, strides, token_slots_or_meta, add_inputs, after_shrink)
    return y


def lora_expand_stacked_triton(
    out: torch.Tensor,
    n_base: int,
    lora_b: tuple[torch.Tensor, ...],
    token_slots_or_meta: torch.Tensor | SegmentMeta,
) -> torch.Tensor:
    """The stacked layout's expand: out [T, N + S * L * R] is x @ [W; A]^T, whose last
    S * L * R columns are every slot's shrink (slice-major, then slot, then rank); adds
    B_s[slot_t] @ out[t, N + (s * L + slot_t) * R : ... + R] into y = out[:, :N] in place
    and returns y (a view of out). lora_b: S x [L, N_s, R]."""
    y = out[:, :n_base]
    sl = check_y_b(y, lora_b)
    num_slots, rank = sl.shapes[0][0], sl.shapes[0][2]
    if out.shape[1] != n_base + sl.count * num_slots * rank or out.stride(1) != 1:
        raise ValueError(
            f"out: [.., {out.shape[1]}] (column stride {out.stride(1)}); allowed: "
            f"[T, {n_base} + {sl.count} x {num_slots} x {rank}] with unit column stride"
        )
    h = out[:, n_base:]
    strides = (num_slots * rank, out.stride(0), 1, rank)
    _launch(y, h, sl, strides, token_slots_or_meta, True, False)
    return y


def _launch(y, buf, sl: Slices, buf_strides, token_slots_or_meta, add_inputs, after_shrink):
    """One launch of the expand kernel; buf_strides: (slice, token, rank, slot) of its input."""
    if y.shape[0] == 0:
        return
    num_slots, rank = sl.shapes[0][0], sl.shapes[0][2]
    meta = as_meta(token_slots_or_meta, y.shape[0], num_slots, y.device, rank)
    pdl = after_shrink and pdl_enabled(y.device)
    plan = _plan(
        y.shape[0], sl.shapes, sl.strides, meta.block_m, meta.expected_slots, y.dtype,
        bool(add_inputs), pdl, CONFIG_OVERRIDE,
    )  # fmt: skip
    off1, off2 = sl.offsets
    _EXPAND(
        plan.grid,
        (y, buf, sl.base, meta.tile_slot, meta.tile_rank, meta.tile_tok, meta.num_tiles),
        (plan.grid[1], off1, off2, *plan.scalars, y.stride(0), y.stride(1), *buf_strides, rank),
        plan.constexprs,
        **plan.options,
    )


class _Plan(NamedTuple):
    """An expand launch's shape, from host values only (`_plan`)."""

    grid: tuple[int, int]
    scalars: tuple[int, ...]
    """The B strides (per slice: slot, column, rank), column counts and group starts."""
    constexprs: dict
    options: dict


@plan_cache
def _plan(
    tokens: int, shapes: tuple, strides: tuple, bm: int, meta_expected: int | None,
    dtype: torch.dtype, add_inputs: bool, pdl: bool, override: ExpandConfig | None,
) -> _Plan:  # fmt: skip
    """The expand's launch for these host values: the same for every layer of a group in
    one step, so a step plans each group once (as lora_shrink._plan)."""
    num_slots, rank = shapes[0][0], shapes[0][2]
    sizes = [sh[1] for sh in shapes]
    br = block_r(rank)
    cfg = override or default_config(bm, br, max(sizes))
    bn = cfg.block_n
    groups = [cdiv(n, bn * cfg.n_iters) for n in sizes]  # column groups per slice
    starts = [sum(groups[:i]) for i in range(1, MAX_SLICES)]
    total = sum(groups)
    nt1, nt2 = [st if i + 1 < len(sizes) else total for i, st in enumerate(starts)]
    ns = sizes + [0] * (MAX_SLICES - len(sizes))
    per_slice = [per_slice_strides(strides, d) for d in range(3)]
    expected = grid_expected(bm, meta_expected)
    programs = tile_programs(tokens, num_slots, bm, expected)
    constexprs = dict(
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=br, N_ITERS=cfg.n_iters, ADD_INPUTS=add_inputs,
        TILE_COPIES=tile_copies(tokens, num_slots, bm, programs),
        WAIT=pdl, PRECISION=dot_precision(dtype), LATE_ADD=cfg.late_add,
    )  # fmt: skip
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_pdl(pdl))
    scalars = (*per_slice[0], *per_slice[1], *per_slice[2], *ns, nt1, nt2)
    return _Plan((total, programs), scalars, constexprs, options)
