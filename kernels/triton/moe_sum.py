"""The last step of kernels.fused_moe: each token's k weighted expert outputs summed.

The down kernel writes one row of y per pair of a local expert and nothing for the other
pairs, so y starts uninitialised (no [T, k, H] zero fill): this sum reads only the rows
of pairs whose id is in [0, E_local). It adds them in fp32 in choice order (0, 1, ...)
from 0.0 and rounds once to out's dtype: deterministic, and bit for bit what
torch.sum(y.view(T, k, H), dim=1) gave on a y zeroed at the other pairs wherever torch
adds in that order (k <= 2 on any device, which the tests check; torch may group longer
sums otherwise: its CPU fp32 sum does from k = 5).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.common import cdiv, next_pow2

BLOCK_T, BLOCK_N = 32, 1024
"""Tokens and columns of H per program, at most (a decode token's row spread over
H / 1024 programs)."""
TILE = 4096
"""Elements of out per program, at most (32 tokens x 128 columns)."""


@triton.jit
def _moe_sum_kernel(
    y_ptr, ids_ptr, out_ptr, T, H, E,
    stride_yp, stride_yn, stride_it, stride_ik, stride_ot, stride_on,
    TOP_K: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """Semantics (program = BT tokens t, BN columns n):
    acc = 0 (fp32); for j < TOP_K: if 0 <= ids[t, j] < E: acc += y[t * TOP_K + j, n]
    out[t, n] = dtype(acc)"""
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    t_mask = offs_t < T
    n_mask = offs_n < H
    tok = offs_t.to(tl.int64)
    acc = tl.zeros((BT, BN), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        ids = tl.load(ids_ptr + tok * stride_it + j * stride_ik, mask=t_mask, other=-1)
        local = t_mask & (ids >= 0) & (ids < E)
        y_ptrs = y_ptr + (tok * TOP_K + j)[:, None] * stride_yp + offs_n[None, :] * stride_yn
        acc += tl.load(y_ptrs, mask=local[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
    out_ptrs = out_ptr + tok[:, None] * stride_ot + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & n_mask[None, :])


def tiles(tokens: int, hidden: int) -> tuple[int, int]:
    """(tokens, columns) per program: powers of two, BLOCK_T x BLOCK_N and TILE at most."""
    bt = min(BLOCK_T, next_pow2(tokens))
    return bt, max(16, min(BLOCK_N, TILE // bt, next_pow2(hidden)))


def moe_sum(
    y: torch.Tensor, topk_ids: torch.Tensor, num_local: int, out: torch.Tensor
) -> torch.Tensor:
    """y: [T * k, H], pair t * k + j's weighted expert output (read only where
    topk_ids[t, j] is in [0, num_local)); topk_ids: int [T, k]; out: [T, H] (any
    strides), overwritten with the sums -> out. One launch; none for T = 0."""
    tokens, top_k = topk_ids.shape
    hidden = out.shape[1]
    if tokens == 0:
        return out
    bt, bn = tiles(tokens, hidden)
    _moe_sum_kernel[(cdiv(tokens, bt), cdiv(hidden, bn))](
        y, topk_ids, out, tokens, hidden, num_local,
        *y.stride(), *topk_ids.stride(), *out.stride(),
        TOP_K=top_k, BT=bt, BN=bn,
    )  # fmt: skip
    return out
