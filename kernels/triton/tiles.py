"""Triton building blocks shared by the shrink, expand and fused kernels.

A tile is up to BLOCK_M tokens of one slot (kernels.meta.SegmentMeta): its slot, rank
and token rows are three independent loads, so a program starts moving x / A / B / y
after one round trip to memory instead of a chain of dependent index loads.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pick(s, v0, v1, v2):
    """v0, v1 or v2 by slice index s (0, 1, 2)."""
    return tl.where(s == 0, v0, tl.where(s == 1, v1, v2))


@triton.jit
def load_tile(tile, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, R, BLOCK_M: tl.constexpr):
    """(slot, rank, tok int64 [BLOCK_M], m_mask [BLOCK_M]) of one tile; rank <= R.

    Rows past the tile's tokens have tok = 0 and m_mask False (loads of them are masked).
    """
    offs_m = tl.arange(0, BLOCK_M)
    slot = tl.load(tile_slot_ptr + tile)
    rank = tl.minimum(tl.load(tile_rank_ptr + tile), R)
    tok = tl.load(tile_tok_ptr + tile * BLOCK_M + offs_m)
    m_mask = tok >= 0
    return slot, rank, tl.where(m_mask, tok, 0).to(tl.int64), m_mask


@triton.jit
def load_k(ptrs, row_mask, k, offs_k, H, EVEN_K: tl.constexpr, ROW_MASK: tl.constexpr = True):
    """ptrs' [rows, BLOCK_K] block at column offset k: columns past H read as 0, and so do
    rows off row_mask when ROW_MASK (else they are read: their addresses must be valid)."""
    if ROW_MASK:
        if EVEN_K:
            return tl.load(ptrs, mask=row_mask[:, None], other=0.0)
        return tl.load(ptrs, mask=row_mask[:, None] & ((offs_k + k) < H)[None, :], other=0.0)
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=((offs_k + k) < H)[None, :], other=0.0)


@triton.jit
def x_rows(x_ptr, tok, offs_k, stride_xt, stride_xh, OFFS32: tl.constexpr):
    """Pointers to x[tok, offs_k]; OFFS32: every offset into x fits in int32 (checked on
    the host), so the offsets are 32-bit arithmetic (one multiply-add per element instead of
    a 64-bit product and add)."""
    if OFFS32:
        return x_ptr + (tok.to(tl.int32)[:, None] * stride_xt + offs_k[None, :] * stride_xh)
    return x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xh


@triton.jit
def shrink_acc(
    x_ptr, a_ptr, off1, off2, tok, m_mask, r_mask, k0, k_len,
    stride_xt, stride_xh, stride_ar, stride_ah, H,
    NSL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, LEAN_X: tl.constexpr = False,
):  # fmt: skip
    """Semantics: for j < NSL (slice j at a_ptr + (0, off1, off2)[j], rows of one slot):
        acc_j[m, r] = sum_{k0 <= k < k0 + k_len, k < H} x[tok_m, k] * A_j[r, k]   (r_mask rows)
    -> (acc0, acc1, acc2) float32 [BLOCK_M, BLOCK_R] (unused ones stay zero).
    LEAN_X: x rows off m_mask are read too (tok is 0 there, load_tile) instead of masked:
    their sums land only in acc rows the caller's store masks; x offsets fit in int32.
    """
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    x_ptrs = x_rows(x_ptr, tok, offs_k, stride_xt, stride_xh, LEAN_X)
    a0 = a_ptr + offs_r[:, None] * stride_ar + offs_k[None, :] * stride_ah
    a1 = a0 + off1
    a2 = a0 + off2
    acc0 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, k_len, BLOCK_K):
        xv = load_k(x_ptrs, m_mask, k, offs_k, H, EVEN_K, not LEAN_X)
        acc0 += tl.dot(xv, tl.trans(load_k(a0, r_mask, k, offs_k, H, EVEN_K)),
                       input_precision=PRECISION)  # fmt: skip
        if NSL > 1:
            acc1 += tl.dot(xv, tl.trans(load_k(a1, r_mask, k, offs_k, H, EVEN_K)),
                           input_precision=PRECISION)  # fmt: skip
        if NSL > 2:
            acc2 += tl.dot(xv, tl.trans(load_k(a2, r_mask, k, offs_k, H, EVEN_K)),
                           input_precision=PRECISION)  # fmt: skip
        x_ptrs += BLOCK_K * stride_xh
        a0 += BLOCK_K * stride_ah
        a1 += BLOCK_K * stride_ah
        a2 += BLOCK_K * stride_ah
    return acc0, acc1, acc2


@triton.jit
def stacked_rows(a_slot, off1, off2, rank, stride_ar, NSL: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_S: tl.constexpr):  # fmt: skip
    """The NSL slices' A rows of one slot stacked as one [BLOCK_S] operand (BLOCK_S: a power
    of two >= NSL * BLOCK_R): row j is slice j // BLOCK_R's rank row j % BLOCK_R.
    -> (row pointers at column 0, row mask (slice < NSL and rank row < rank), slice, rank row)."""
    offs_j = tl.arange(0, BLOCK_S)
    j_s = offs_j // BLOCK_R
    j_r = offs_j % BLOCK_R
    j_mask = (j_s < NSL) & (j_r < rank)
    # the slice's offset by multiplies, not pick's tl.where: the compiler loses the rows'
    # alignment through a select of tensors (2-byte loads, not pipelined, on sm_90)
    off = (j_s == 1).to(tl.int64) * off1 + (j_s == 2).to(tl.int64) * off2
    return a_slot + off + j_r * stride_ar, j_mask, j_s, j_r


@triton.jit
def shrink_acc_rows(
    x_ptr, a_rows, tok, m_mask, j_mask, k0, k_len, stride_xt, stride_xh, stride_ah, H,
    t_rows, t_mask,
    BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr, LEAN_X: tl.constexpr, TAIL: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """Semantics: acc[m, j] = sum_{k0 <= k < k0 + k_len, k < H} x[tok_m, k] * a_rows[j][k]
    (j_mask rows; the others read as 0) -> (float32 [BLOCK_M, BLOCK_J], tail): ONE dot per
    k-step whatever the rows are (stacked_rows: every slice of a slot). TAIL: a second dot
    per k-step of the same x block with t_rows ([BLOCK_T], t_mask), summed into the tail
    float32 [BLOCK_M, BLOCK_T] (else it stays zero): the slice that would pad the stacked
    operand to a power of two. LEAN_X as in shrink_acc.
    """
    # The 2-D pointer blocks are rebuilt from the row bases at each step rather than
    # carried through the loop: carried, [64, 128] x and A blocks took every register
    # and spilled (sm_90, BLOCK_S 64).
    acc = tl.zeros((BLOCK_M, BLOCK_J), dtype=tl.float32)
    tail = tl.zeros((BLOCK_M, BLOCK_T), dtype=tl.float32)
    for i in range(0, tl.cdiv(k_len, BLOCK_K)):
        # k0 + i * BLOCK_K, not a loop variable stepping by BLOCK_K: the compiler proves
        # the alignment of this form (16-byte loads); of the other it saw 2-byte ones
        offs_k = k0 + i * BLOCK_K + tl.arange(0, BLOCK_K)
        xv = load_k(x_rows(x_ptr, tok, offs_k, stride_xt, stride_xh, LEAN_X), m_mask, 0,
                    offs_k, H, EVEN_K, not LEAN_X)  # fmt: skip
        av = load_k(a_rows[:, None] + offs_k[None, :] * stride_ah, j_mask, 0, offs_k, H, EVEN_K)
        acc += tl.dot(xv, tl.trans(av), input_precision=PRECISION)
        if TAIL:
            tv = load_k(t_rows[:, None] + offs_k[None, :] * stride_ah, t_mask, 0, offs_k, H,
                        EVEN_K)  # fmt: skip
            tail += tl.dot(xv, tl.trans(tv), input_precision=PRECISION)
    return acc, tail


@triton.jit
def expand_operands(
    y_ptr, b_ptr, tok, m_mask, r_mask, col0, offs_n, n_mask,
    stride_bn, stride_br, stride_yt, stride_yn,
    BLOCK_R: tl.constexpr, ADD_INPUTS: tl.constexpr,
):  # fmt: skip
    """The operands of one expand block that do not depend on the shrink output:
    -> (y_ptrs, mask, y_old (0.0 unless ADD_INPUTS), b [BLOCK_R, BLOCK_N]).
    b_ptr: one slot of one slice [N, R]; only the r_mask rows of b are read.
    """
    offs_r = tl.arange(0, BLOCK_R)
    y_ptrs = y_ptr + tok[:, None] * stride_yt + (col0 + offs_n)[None, :] * stride_yn
    mask = m_mask[:, None] & n_mask[None, :]
    y_old = 0.0
    if ADD_INPUTS:  # issued first: the y read overlaps the B read
        y_old = tl.load(y_ptrs, mask=mask, other=0.0)
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br
    b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
    return y_ptrs, mask, y_old, b


@triton.jit
def expand_store(y_ptrs, mask, y_old, b, h, ADD_INPUTS: tl.constexpr, PRECISION: tl.constexpr,
                 LATE_ADD: tl.constexpr = False):  # fmt: skip
    """y[rows, cols] = (y_old if ADD_INPUTS else 0) + h @ b (h: [BLOCK_M, BLOCK_R], b's dtype).

    LATE_ADD: the product is rounded to y's dtype first and y_old added to it where y_old
    was loaded (one layout change of the product instead of one of y_old into the dot's
    layout and one of the sum back out: each a round trip through shared memory)."""
    acc = tl.dot(h, b, input_precision=PRECISION)
    if ADD_INPUTS and LATE_ADD:
        acc = y_old.to(tl.float32) + acc.to(y_ptrs.dtype.element_ty).to(tl.float32)
    elif ADD_INPUTS:
        acc += y_old.to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def expand_block(
    y_ptr, h, b_ptr, tok, m_mask, r_mask, col0, offs_n, n_mask,
    stride_bn, stride_br, stride_yt, stride_yn,
    BLOCK_R: tl.constexpr, ADD_INPUTS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Semantics: for rows m with m_mask, n in offs_n with n_mask:
        y[tok_m, col0 + n] = (y[tok_m, col0 + n] if ADD_INPUTS else 0) + sum_r h[m, r] * B[n, r]
    h: [BLOCK_M, BLOCK_R] in B's dtype (columns past the rank are zero); b_ptr: one slot
    of one slice [N, R]; only the r_mask columns of B are read.
    """
    y_ptrs, mask, y_old, b = expand_operands(
        y_ptr, b_ptr, tok, m_mask, r_mask, col0, offs_n, n_mask,
        stride_bn, stride_br, stride_yt, stride_yn, BLOCK_R, ADD_INPUTS,
    )  # fmt: skip
    expand_store(y_ptrs, mask, y_old, b, h, ADD_INPUTS, PRECISION)


@triton.jit
def store(out_ptrs, acc, mask, USE_ATOMIC: tl.constexpr):
    """out (+)= acc: fp32 atomics where K splits meet in one output, else a plain store."""
    if USE_ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")
    else:
        tl.store(out_ptrs, acc, mask=mask)


@triton.jit
def store_slices(out_ptrs, stride_os, acc0, acc1, acc2, scale, mask, NSL: tl.constexpr,
                 USE_ATOMIC: tl.constexpr):  # fmt: skip
    """out[j] (+)= scale * acc_j at out_ptrs + j * stride_os, for the NSL slices j."""
    store(out_ptrs, acc0 * scale, mask, USE_ATOMIC)
    if NSL > 1:
        store(out_ptrs + stride_os, acc1 * scale, mask, USE_ATOMIC)
    if NSL > 2:
        store(out_ptrs + 2 * stride_os, acc2 * scale, mask, USE_ATOMIC)
