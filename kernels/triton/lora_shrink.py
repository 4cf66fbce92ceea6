"""Segmented LoRA shrink (Punica SGMV): out[s, t] = scale * A_s[slot_t] @ x[t], one launch.

Grid: (slice, tile program, k-split). A tile is up to BLOCK_M tokens of one slot
(from SegmentMeta); programs stride over the valid tiles only. Split-K over H gives decode-sized
batches enough programs to stream A at full bandwidth; partial sums meet through
fp32 atomics in the zeroed output. Rows r >= rank of the slot are masked, so a
low-rank adapter in a high-rank pool reads only its own rows of A.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.meta import SegmentMeta, tile_programs
from kernels.triton.common import (
    as_meta,
    block_r,
    check_device,
    check_slices,
    num_sms,
    slice_offsets,
)

_STAGES = 3


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, out_ptr,
    tile_slot_ptr, tile_start_ptr, tile_rows_ptr, sorted_idx_ptr, slot_ranks_ptr,
    num_tiles_ptr, num_programs,
    a_off1, a_off2,
    stride_xt, stride_xh, stride_al, stride_ar, stride_ah, stride_os, stride_ot,
    H, R, k_per_split, scale,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, USE_ATOMIC: tl.constexpr,
):  # fmt: skip
    """Semantics (one program = slice s, k-split, tiles pid, pid + num_programs, ...):
    for t in tile tokens, r < rank[slot]: out[s, t, r] (+)= scale * sum_{k in split} A_s[slot, r, k] * x[t, k]
    """
    pid_s = tl.program_id(0)
    pid_k = tl.program_id(2)
    slice_off = tl.where(pid_s == 0, 0, tl.where(pid_s == 1, a_off1, a_off2)).to(tl.int64)
    k0 = pid_k.to(tl.int64) * k_per_split
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    for tile in range(tl.program_id(1), tl.load(num_tiles_ptr), num_programs):
        slot = tl.load(tile_slot_ptr + tile)
        start = tl.load(tile_start_ptr + tile)
        rows = tl.load(tile_rows_ptr + tile)
        rank = tl.minimum(tl.load(slot_ranks_ptr + slot), R)
        m_mask = offs_m < rows
        tok = tl.load(sorted_idx_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
        r_mask = offs_r < rank
        a_base = a_ptr + slice_off + slot.to(tl.int64) * stride_al
        x_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xh
        a_ptrs = a_base + offs_r[:, None] * stride_ar + offs_k[None, :] * stride_ah
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k in range(0, k_per_split, BLOCK_K):
            if EVEN_K:
                xv = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
                av = tl.load(a_ptrs, mask=r_mask[:, None], other=0.0)
            else:
                k_mask = (offs_k + k) < H
                xv = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                av = tl.load(a_ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            acc += tl.dot(xv, tl.trans(av))
            x_ptrs += BLOCK_K * stride_xh
            a_ptrs += BLOCK_K * stride_ah
        acc = acc * scale
        out_ptrs = (
            out_ptr + pid_s.to(tl.int64) * stride_os + tok[:, None] * stride_ot + offs_r[None, :]
        )
        mask = m_mask[:, None] & r_mask[None, :]
        if USE_ATOMIC:
            tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")
        else:
            tl.store(out_ptrs, acc, mask=mask)


def _config(
    num_slices: int, tiles: int, hidden: int, bm: int, br: int, elem: int, device: torch.device
):
    """(BLOCK_K, k_per_split, split): ~8 programs per SM so decode streams A at full bandwidth."""
    bk = 256
    while bk > 32 and (bm + br) * bk * elem * _STAGES > 100_000:  # smem per program
        bk //= 2
    bk = min(bk, max(16, triton.next_power_of_2(hidden)))
    steps = triton.cdiv(hidden, bk)
    want = max(1, (8 * num_sms(device)) // max(1, tiles * num_slices))
    split = min(want, steps)
    k_per_split = triton.cdiv(steps, split) * bk
    return bk, k_per_split, triton.cdiv(hidden, k_per_split)


def _check(x: torch.Tensor, lora_a) -> tuple[int, int, int]:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x: a 2-D tensor [T, H]; got {getattr(x, 'shape', x)!r}")
    check_device(x, "x")
    first = check_slices(lora_a, "lora_a", x.device, x.dtype)
    for s, a in enumerate(lora_a):
        if a.shape != first.shape or a.stride() != first.stride():
            raise ValueError(
                f"lora_a[{s}]: shape/strides differ from lora_a[0]; all slices must match"
            )
    num_slots, rank, hidden = first.shape
    if hidden != x.shape[1]:
        raise ValueError(f"lora_a: H={hidden}; x has H={x.shape[1]}")
    return num_slots, rank, hidden


def lora_shrink_triton(
    x: torch.Tensor,
    lora_a: tuple[torch.Tensor, ...],
    token_slots_or_meta: torch.Tensor | SegmentMeta,
    *,
    scale: float = 1.0,
) -> torch.Tensor:
    """x: [T, H] (any strides); lora_a: S x [L, R, H] (dtype of x) -> float32 [S, T, R].

    token_slots_or_meta: int [T] slot map, or a SegmentMeta built for (T, L).
    """
    num_slots, rank, hidden = _check(x, lora_a)
    tokens, num_slices = x.shape[0], len(lora_a)
    out = torch.zeros(num_slices, tokens, rank, dtype=torch.float32, device=x.device)
    if tokens == 0:
        return out
    meta = as_meta(token_slots_or_meta, tokens, num_slots, x.device)
    br = block_r(rank)
    programs = tile_programs(tokens, num_slots, meta.block_m)
    bk, k_per_split, split = _config(
        num_slices, programs, hidden, meta.block_m, br, x.element_size(), x.device
    )
    off1, off2 = slice_offsets(lora_a)
    a = lora_a[0]
    _shrink_kernel[(num_slices, programs, split)](
        x, a, out,
        meta.tile_slot, meta.tile_start, meta.tile_rows, meta.sorted_idx, meta.slot_ranks,
        meta.num_tiles, programs,
        off1, off2,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), out.stride(0), out.stride(1),
        hidden, rank, k_per_split, float(scale),
        BLOCK_M=meta.block_m, BLOCK_R=br, BLOCK_K=bk,
        EVEN_K=hidden % k_per_split == 0, USE_ATOMIC=split > 1,
        num_warps=4, num_stages=_STAGES,
    )  # fmt: skip
    return out
