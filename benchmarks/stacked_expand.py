"""The expand of the stacked-layout probe (`cublas_concat_probe.py`): kernels.lora_expand's
Triton kernel with one change, its input read out of the stacked GEMM's output.

The library's expand reads the shrink's fp32 workspace buf[s, t, r]. Here the shrink is
the stacked GEMM's extra columns, out[t, N + (s * S + slot) * R + r] (bf16), so the load
adds slot * R to the offset: one more term, `stride_bslot`. Everything else is the
library's kernel as it stands (tiles, column groups, masks, config); a copy, so that the
library is untouched by a probe.

A probe's helper, not a kernel of the library (benchmarks/README.md, "Probes").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.meta import SegmentMeta, tile_copies, tile_programs
from kernels.triton.common import MAX_SLICES, block_r, cdiv, dot_precision, expected_slots
from kernels.triton.lora_expand import check_y_b, default_config
from kernels.triton.tiles import expand_operands, expand_store, load_tile, pick


@triton.jit
def _tile(
    y_ptr, h_ptr, b_slice, tile, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr,
    s, col0, offs_n, n_s, stride_bl, stride_bn, stride_br,
    stride_yt, stride_yn, stride_hs, stride_ht, stride_hslot, R,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr, LATE_ADD: tl.constexpr,
):  # fmt: skip
    slot, rank, tok, m_mask = load_tile(
        tile, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, R, BLOCK_M
    )
    if slot >= 0:
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        b_slot = b_slice + slot.to(tl.int64) * stride_bl
        y_ptrs, mask, y_old, b = expand_operands(
            y_ptr, b_slot, tok, m_mask, r_mask, col0, offs_n, offs_n < n_s,
            stride_bn, stride_br, stride_yt, stride_yn, BLOCK_R, True,
        )  # fmt: skip
        h_ptrs = (
            h_ptr
            + s.to(tl.int64) * stride_hs
            + slot.to(tl.int64) * stride_hslot
            + tok[:, None] * stride_ht
            + offs_r[None, :]
        )
        h = tl.load(h_ptrs, mask=m_mask[:, None] & r_mask[None, :], other=0.0).to(b.dtype)
        expand_store(y_ptrs, mask, y_old, b, h, True, PRECISION, LATE_ADD)


@triton.jit
def _kernel(
    y_ptr, h_ptr, b_ptr,
    tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, num_tiles_ptr, num_programs,
    b_off1, b_off2, stride_bl0, stride_bl1, stride_bl2, stride_bn0, stride_bn1, stride_bn2,
    stride_br0, stride_br1, stride_br2,
    n0, n1, n2, nt1, nt2,
    stride_yt, stride_yn, stride_hs, stride_ht, stride_hslot,
    R,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    TILE_COPIES: tl.constexpr, PRECISION: tl.constexpr, LATE_ADD: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    s = (pid_n >= nt1).to(tl.int32) + (pid_n >= nt2).to(tl.int32)
    n_s = pick(s, n0, n1, n2)
    col0 = pick(s, 0, n0, n0 + n1).to(tl.int64)
    offs_n = (pid_n - pick(s, 0, nt1, nt2)) * BLOCK_N + tl.arange(0, BLOCK_N)
    b_slice = b_ptr + pick(s, 0, b_off1, b_off2).to(tl.int64)
    stride_bl = pick(s, stride_bl0, stride_bl1, stride_bl2).to(tl.int64)
    stride_bn = pick(s, stride_bn0, stride_bn1, stride_bn2)
    stride_br = pick(s, stride_br0, stride_br1, stride_br2)
    if TILE_COPIES > 1:
        num_tiles = tl.load(num_tiles_ptr)
    for j in tl.static_range(TILE_COPIES):
        tile = tl.program_id(1) + j * num_programs
        if j == 0:
            go = True
        else:
            go = tile < num_tiles
        if go:
            _tile(
                y_ptr, h_ptr, b_slice, tile, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr,
                s, col0, offs_n, n_s, stride_bl, stride_bn, stride_br,
                stride_yt, stride_yn, stride_hs, stride_ht, stride_hslot, R,
                BLOCK_M, BLOCK_N, BLOCK_R, PRECISION, LATE_ADD,
            )  # fmt: skip


def stacked_expand(out: torch.Tensor, n_base: int, lora_b, meta: SegmentMeta) -> None:
    """out: the stacked GEMM's [T, N + S * L * R] output; y = out[:, :N] += B_s[slot_t] @
    h[t, s, slot_t] for every slice s, h being out[:, N:] as [T, S, L, R]."""
    y, h = out[:, :n_base], out[:, n_base:]
    sl = check_y_b(y, lora_b)
    num_slots, rank = sl.shapes[0][0], sl.shapes[0][2]
    sizes = [sh[1] for sh in sl.shapes]
    br = block_r(rank)
    cfg = default_config(meta.block_m, br, max(sizes))
    bn = cfg.block_n  # one block per program (n_iters 1), as at decode
    groups = [cdiv(n, bn) for n in sizes]
    starts = [sum(groups[:i]) for i in range(1, MAX_SLICES)]
    total = sum(groups)
    nt1, nt2 = [st if i + 1 < len(sizes) else total for i, st in enumerate(starts)]
    ns = sizes + [0] * (MAX_SLICES - len(sizes))
    stride_l, stride_n, stride_r = (sl.per_slice(d) for d in range(3))
    off1, off2 = sl.offsets
    programs = tile_programs(y.shape[0], num_slots, meta.block_m, expected_slots(meta))
    _kernel[(total, programs)](
        y, h, sl.base,
        meta.tile_slot, meta.tile_rank, meta.tile_tok, meta.num_tiles, programs,
        off1, off2, *stride_l, *stride_n, *stride_r,
        ns[0], ns[1], ns[2], nt1, nt2,
        y.stride(0), y.stride(1), num_slots * rank, out.stride(0), rank,
        rank,
        BLOCK_M=meta.block_m, BLOCK_N=bn, BLOCK_R=br,
        TILE_COPIES=tile_copies(y.shape[0], num_slots, meta.block_m, programs),
        PRECISION=dot_precision(y.dtype), LATE_ADD=cfg.late_add,
        num_warps=cfg.num_warps, num_stages=1,
    )  # fmt: skip
