"""Stream-K segmented shrink for prefill at rank >= 64 (shrink_plan.stream_config): a
few persistent programs per SM, each walking an equal run of (tile, k-step) items in one
pipelined loop. Semantics as kernels/triton/lora_shrink.py's split-K kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from kernels.meta import SegmentMeta, max_tiles
from kernels.triton.common import Slices, cdiv, dot_precision, num_sms
from kernels.triton.shrink_plan import ShrinkConfig, block_k_for, lean_x_for, offsets_fit_i32
from kernels.triton.tiles import load_k, load_tile, pick, store_slices, x_rows


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
                store_slices(out_ptrs, stride_os, acc0, acc1, acc2, scale, mask, NSL, False)
            else:
                store_slices(out_ptrs, stride_os, acc0, acc1, acc2, scale, mask, NSL, True)
            acc0 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            acc1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            acc2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)


def launch_stream(x, sl: Slices, out, meta: SegmentMeta, cfg: ShrinkConfig, groups: int,
                  nsl: int, br: int, scale: float, dependents: bool) -> None:  # fmt: skip
    """_shrink_stream_kernel over (groups, programs): programs_per_sm per SM in all, at
    most one per work item of the tile bound."""
    tokens, hidden = x.shape
    num_slots, rank = sl.shapes[0][0], sl.shapes[0][1]
    bk = block_k_for(cfg, hidden)
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
        LEAN_X=lean_x_for(cfg, offsets_fit_i32(x)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
