"""Segmented LoRA expand (Punica SGMV): y[t, off_s:off_s+N_s] (+)= B_s[slot_t] @ buf[s, t], one launch.

Grid: (tile program, n-tile over all slices); programs stride over the valid tiles. The n-tiles of slices with unequal N are laid
end to end, so q, k and v (or gate and up) share one launch. Each (tile, n-tile)
is written by exactly one program: no atomics, rows of slot -1 are never touched.
Columns r >= rank of the slot are masked, so only the slot's own rank is read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.meta import SegmentMeta, tile_programs
from kernels.triton.common import (
    MAX_SLICES,
    as_meta,
    block_r,
    check_device,
    check_slices,
    slice_offsets,
)


@triton.jit
def _pick(s, v0, v1, v2):
    return tl.where(s == 0, v0, tl.where(s == 1, v1, v2))


@triton.jit
def _expand_kernel(
    y_ptr, buf_ptr, b_ptr,
    tile_slot_ptr, tile_start_ptr, tile_rows_ptr, sorted_idx_ptr, slot_ranks_ptr,
    num_tiles_ptr, num_programs,
    b_off1, b_off2, stride_bl0, stride_bl1, stride_bl2, stride_bn, stride_br,
    n0, n1, n2, nt1, nt2,
    stride_yt, stride_yn, stride_bs, stride_bt, stride_bk,
    R,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    ADD_INPUTS: tl.constexpr,
):  # fmt: skip
    """Semantics (one program = n-tile j of slice s, tiles pid, pid + num_programs, ...):
    for t in tile tokens, n in tile j: y[t, off_s + n] = (y[t, off_s + n] if ADD_INPUTS else 0)
                                         + sum_{r < rank[slot]} B_s[slot, n, r] * buf[s, t, r]
    """
    pid_n = tl.program_id(1)
    s = (pid_n >= nt1).to(tl.int32) + (pid_n >= nt2).to(tl.int32)
    n_s = _pick(s, n0, n1, n2)
    col0 = _pick(s, 0, n0, n0 + n1).to(tl.int64)
    offs_n = (pid_n - _pick(s, 0, nt1, nt2)) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_s
    b_slice = b_ptr + _pick(s, 0, b_off1, b_off2).to(tl.int64)
    stride_bl = _pick(s, stride_bl0, stride_bl1, stride_bl2).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    for tile in range(tl.program_id(0), tl.load(num_tiles_ptr), num_programs):
        slot = tl.load(tile_slot_ptr + tile)
        start = tl.load(tile_start_ptr + tile)
        rows = tl.load(tile_rows_ptr + tile)
        rank = tl.minimum(tl.load(slot_ranks_ptr + slot), R)
        m_mask = offs_m < rows
        tok = tl.load(sorted_idx_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
        r_mask = offs_r < rank
        buf_ptrs = (
            buf_ptr
            + s.to(tl.int64) * stride_bs
            + tok[:, None] * stride_bt
            + offs_r[None, :] * stride_bk
        )
        h = tl.load(buf_ptrs, mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        b_ptrs = (
            b_slice
            + slot.to(tl.int64) * stride_bl
            + offs_n[None, :] * stride_bn
            + offs_r[:, None] * stride_br
        )
        b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(h.to(b.dtype), b)
        y_ptrs = y_ptr + tok[:, None] * stride_yt + (col0 + offs_n)[None, :] * stride_yn
        mask = m_mask[:, None] & n_mask[None, :]
        if ADD_INPUTS:
            acc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _check(y: torch.Tensor, buf: torch.Tensor, lora_b) -> tuple[int, int, list[int]]:
    if not isinstance(y, torch.Tensor) or y.dim() != 2:
        raise ValueError(f"y: a 2-D tensor [T, sum N_s]; got {getattr(y, 'shape', y)!r}")
    check_device(y, "y")
    first = check_slices(lora_b, "lora_b", y.device)
    num_slots, rank = first.shape[0], first.shape[2]
    sizes = [b.shape[1] for b in lora_b]
    for s, b in enumerate(lora_b):
        if b.shape[2] != rank or b.stride()[1:] != first.stride()[1:]:
            raise ValueError(
                f"lora_b[{s}]: rank/inner strides differ from lora_b[0]; all slices must match"
            )
    if y.shape[1] != sum(sizes) or y.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"y: {y.dtype} [.., {y.shape[1]}]; allowed: fp16/bf16/fp32 [T, {sum(sizes)}]"
        )
    want = (len(lora_b), y.shape[0], rank)
    if not isinstance(buf, torch.Tensor) or tuple(buf.shape) != want or buf.device != y.device:
        raise ValueError(
            f"buf: shape {tuple(getattr(buf, 'shape', ()))}; allowed: {list(want)} on {y.device}"
        )
    return num_slots, rank, sizes


def lora_expand_triton(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: tuple[torch.Tensor, ...],
    token_slots_or_meta: torch.Tensor | SegmentMeta,
    *,
    add_inputs: bool = True,
) -> torch.Tensor:
    """y: [T, sum N_s] (in place, any strides); buf: [S, T, R] (fp32 from shrink); lora_b: S x [L, N_s, R].

    token_slots_or_meta: int [T] slot map, or a SegmentMeta built for (T, L). Returns y.
    """
    num_slots, rank, sizes = _check(y, buf, lora_b)
    if y.shape[0] == 0:
        return y
    meta = as_meta(token_slots_or_meta, y.shape[0], num_slots, y.device)
    br = block_r(rank)
    bn = 128 if br <= 64 else 64
    n_tiles = [triton.cdiv(n, bn) for n in sizes]
    starts = [sum(n_tiles[:i]) for i in range(1, MAX_SLICES)]
    total = sum(n_tiles)
    nt1, nt2 = [st if i + 1 < len(sizes) else total for i, st in enumerate(starts)]
    ns = sizes + [0] * (MAX_SLICES - len(sizes))
    stride_l = [b.stride(0) for b in lora_b] + [0] * (MAX_SLICES - len(sizes))
    off1, off2 = slice_offsets(lora_b)
    b = lora_b[0]
    programs = tile_programs(y.shape[0], num_slots, meta.block_m)
    _expand_kernel[(programs, total)](
        y, buf, b,
        meta.tile_slot, meta.tile_start, meta.tile_rows, meta.sorted_idx, meta.slot_ranks,
        meta.num_tiles, programs,
        off1, off2, stride_l[0], stride_l[1], stride_l[2], b.stride(1), b.stride(2),
        ns[0], ns[1], ns[2], nt1, nt2,
        y.stride(0), y.stride(1), buf.stride(0), buf.stride(1), buf.stride(2),
        rank,
        BLOCK_M=meta.block_m, BLOCK_N=bn, BLOCK_R=br, ADD_INPUTS=bool(add_inputs),
        num_warps=4, num_stages=2,
    )  # fmt: skip
    return y
