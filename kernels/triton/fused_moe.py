"""Fused mixture-of-experts: the routed experts' GEMMs over per-expert tiles; five
launches per call in all (two for the alignment, two GEMMs, the sum), whatever T.

After the device-side alignment (kernels/moe_align.py, here its two launches in
kernels/triton/moe_align.py: (token, choice) pairs grouped by local expert, padded to
BLOCK_M rows per block), each program of
- _gate_up_kernel takes one block (BLOCK_M pairs of one expert) and BLOCK_N columns of
  the intermediate: h[pair, n] = silu(x[tok] . w13[e, n]) * (x[tok] . w13[e, I + n]), the
  gate and up GEMMs in two fp32 accumulators, SiLU and product in the epilogue, stored
  in x's dtype by pair id;
- _down_kernel takes one block and BLOCK_N columns of H: y[pair, n] = w[pair] *
  (h[pair] . w2[e, n]) in fp32, cast to x's dtype (each expert's weighted output rounded
  before the sum, as transformers does) and stored by pair id.
The k rows of a token are then summed (kernels/triton/moe_sum.py: the local pairs' rows
only, in fp32, choice by choice: deterministic; y is never zero-filled, as the rows of
other ranks' pairs are never read). LORAFLEET_MOE_PREP=torch (kernels.backend.moe_prep)
swaps that Triton alignment-and-sum pair for the torch one (align_moe_ref, a zero fill,
torch.sum), to compare against.
Only the experts a block routes to are read, so FLOPs and weight bytes follow the routing.
Programs past the device-side block count exit at once: the grid is sized for the most
blocks T * k pairs can fill, so nothing here waits on the host (CUDA-graph capturable).
Block ids vary fastest in the grid, so the programs running together share a weight tile
(read once from HBM into L2 when an expert has several blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.backend import moe_prep
from kernels.moe_align import align_moe
from kernels.triton.common import DTYPES, cdiv, check_device, dot_precision
from kernels.triton.moe_sum import moe_sum


@dataclass(frozen=True)
class GemmConfig:
    """One GEMM's tile: BLOCK_N output columns, BLOCK_K reduction step, warps, stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoeConfig:
    """block_m rows per block (the alignment's padding), and each GEMM's tile."""

    block_m: int
    gate_up: GemmConfig
    down: GemmConfig


CHUNK_TOKENS = 4096
"""Tokens one pass takes: a longer step runs in chunks of this many, so its temporaries
(h [T k, I] and y [T k, H] in x's dtype: 0.3 GB for a Mixtral-8x7B chunk) stay bounded
whatever max_num_batched_tokens is. At 4096 tokens a pass is already GEMM-sized
(results/moe_gpu_*.json: the fused path's floor ratio flattens from T = 512 on)."""

CONFIG_OVERRIDE: MoeConfig | None = None
"""Set by benchmarks/moe_gpu.py --sweep to time other tiles; None: moe_config's."""


def moe_config(tokens: int, top_k: int, num_local: int, itemsize: int = 2) -> MoeConfig:
    """Tiles by the mean rows per expert (T * k / E_local), from `benchmarks/moe_gpu.py
    --sweep` on an H100 (Mixtral-8x7B shapes, bf16; results/moe_gpu_sweep_h100.json).
    Decode (<= 16 rows an expert) is weight-bound: 16-row blocks; with under one row an
    expert (T = 1), narrow down tiles spread H over enough programs to stream w2 at full
    bandwidth, with more, 128-column 8-warp down tiles (T = 8: 872 vs 904 us). 17-96
    rows: 64-row blocks (T = 128: 1034 vs 1074 us with 32-row ones). 4-byte inputs
    (float32) halve block_k (the 16-bit tiles' pipelined stages would need 240 KB of
    shared memory; the limit is 227 KB) and take at most 64-row blocks (a 128-row fp32
    down tile spills registers). On Qwen3-30B-A3B's and Qwen1.5-MoE's experts (128 x
    768 and 60 x 1408 wide, top-8 and top-4) this rule is within 3.2% of the best of 160
    swept tiles at T = 1-2048 (results/moe_gpu_sweep_qwen{3,2}_h100.json), so they share it."""
    if CONFIG_OVERRIDE is not None:
        return CONFIG_OVERRIDE
    per_expert = tokens * top_k / num_local
    if per_expert < 1:
        cfg = MoeConfig(16, GemmConfig(64, 128, 4, 4), GemmConfig(32, 128, 4, 4))
    elif per_expert <= 16:
        cfg = MoeConfig(16, GemmConfig(64, 128, 4, 4), GemmConfig(128, 64, 8, 4))
    elif per_expert <= 96:
        cfg = MoeConfig(64, GemmConfig(64, 128, 4, 4), GemmConfig(128, 64, 8, 4))
    else:
        cfg = MoeConfig(128, GemmConfig(64, 64, 8, 3), GemmConfig(128, 64, 8, 3))
    if itemsize <= 2:
        return cfg
    return MoeConfig(
        min(cfg.block_m, 64),
        *(replace(g, block_k=g.block_k // 2) for g in (cfg.gate_up, cfg.down)),
    )


@triton.jit
def _block_rows(sorted_ptr, block_expert_ptr, blk, P, BLOCK_M: tl.constexpr):
    """(expert int64, pair int64 [BLOCK_M], row mask) of block blk; padding rows read pair 0."""
    expert = tl.load(block_expert_ptr + blk).to(tl.int64)
    pair = tl.load(sorted_ptr + blk * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pair < P
    return expert, tl.where(m_mask, pair, 0).to(tl.int64), m_mask


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_ptr, block_expert_ptr, num_blocks_ptr,
    P, H, INTER, up_off,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_hp, stride_hn,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Semantics (program = block b of expert e, columns n of the tile):
    for pair p in b, t = p // TOP_K:
        h[p, n] = silu(sum_k x[t, k] w13[e, n, k]) * sum_k x[t, k] w13[e, I + n, k]"""
    blk = tl.program_id(0)
    if blk >= tl.load(num_blocks_ptr):
        return
    expert, pair, m_mask = _block_rows(sorted_ptr, block_expert_ptr, blk, P, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pair // TOP_K)[:, None] * stride_xt + offs_k[None, :] * stride_xh
    g_ptrs = (
        w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
        + offs_k[:, None] * stride_wh
    )  # fmt: skip
    u_ptrs = g_ptrs + up_off  # the up rows: I rows below the gate rows
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, H, BLOCK_K):
        if EVEN_K:
            xv = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            gv = tl.load(g_ptrs, mask=n_mask[None, :], other=0.0)
            uv = tl.load(u_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < H - k
            xv = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            gv = tl.load(g_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            uv = tl.load(u_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc_g = tl.dot(xv, gv, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(xv, uv, acc_u, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K * stride_wh
        u_ptrs += BLOCK_K * stride_wh
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    h_ptrs = h_ptr + pair[:, None] * stride_hp + offs_n[None, :] * stride_hn
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, y_ptr, tw_ptr, sorted_ptr, block_expert_ptr, num_blocks_ptr,
    P, H, INTER,
    stride_hp, stride_hi, stride_we, stride_wn, stride_wi, stride_yp, stride_yn,
    stride_twt, stride_twk,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Semantics (program = block b of expert e, columns n of H):
    for pair p in b: y[p, n] = dtype(tw[p // TOP_K, p % TOP_K] * sum_i h[p, i] w2[e, n, i])"""
    blk = tl.program_id(0)
    if blk >= tl.load(num_blocks_ptr):
        return
    expert, pair, m_mask = _block_rows(sorted_ptr, block_expert_ptr, blk, P, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pair[:, None] * stride_hp + offs_k[None, :] * stride_hi
    w_ptrs = (
        w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
        + offs_k[:, None] * stride_wi
    )  # fmt: skip
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, INTER, BLOCK_K):
        if EVEN_K:
            hv = tl.load(h_ptrs, mask=m_mask[:, None], other=0.0)
            wv = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < INTER - k
            hv = tl.load(h_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            wv = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(hv, wv, acc, input_precision=PRECISION)
        h_ptrs += BLOCK_K * stride_hi
        w_ptrs += BLOCK_K * stride_wi
    tw = tl.load(tw_ptr + (pair // TOP_K) * stride_twt + (pair % TOP_K) * stride_twk, mask=m_mask)
    y = (acc * tw[:, None]).to(y_ptr.dtype.element_ty)
    y_ptrs = y_ptr + pair[:, None] * stride_yp + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, y, mask=m_mask[:, None] & n_mask[None, :])


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """kernels.fused_moe on the Triton kernels (arguments checked by it): -> out [T, H]."""
    check_device(x, "x")
    if x.dtype not in DTYPES:
        raise ValueError(f"x is {x.dtype}; allowed: {', '.join(map(str, DTYPES))}")
    tokens, hidden = x.shape
    if out is None:
        out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    for i in range(0, tokens, CHUNK_TOKENS):  # one pass unless the step is longer
        j = min(i + CHUNK_TOKENS, tokens)
        _fused_pass(x[i:j], w13, w2, topk_ids[i:j], topk_weights[i:j], out[i:j])
    return out


def _fused_pass(x, w13, w2, topk_ids, topk_weights, out) -> None:
    """One pass of 1 to CHUNK_TOKENS tokens: the five launches into out."""
    (tokens, hidden), (num_local, two_i, _) = x.shape, w13.shape
    top_k, inter = topk_ids.shape[1], two_i // 2
    pairs = tokens * top_k
    prep = moe_prep()
    # one row per pair; those of other ranks' pairs are never written: never read by
    # moe_sum, zeros for torch.sum
    make = torch.empty if prep == "triton" else torch.zeros
    y = make(pairs, hidden, dtype=x.dtype, device=x.device)
    if pairs and num_local:  # no local experts: every pair is another rank's
        cfg = moe_config(tokens, top_k, num_local, x.element_size())
        al = align_moe(topk_ids, num_local, cfg.block_m)  # the same prep choice
        grid_m = al.block_expert.shape[0]
        h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
        precision = dot_precision(x.dtype)
        g = cfg.gate_up
        _gate_up_kernel[(grid_m, cdiv(inter, g.block_n))](
            x, w13, h, al.sorted_ids, al.block_expert, al.num_blocks,
            pairs, hidden, inter, inter * w13.stride(1),
            *x.stride(), *w13.stride(), *h.stride(),
            TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k,
            EVEN_K=hidden % g.block_k == 0, PRECISION=precision,
            num_warps=g.num_warps, num_stages=g.num_stages,
        )  # fmt: skip
        d = cfg.down
        _down_kernel[(grid_m, cdiv(hidden, d.block_n))](
            h, w2, y, topk_weights, al.sorted_ids, al.block_expert, al.num_blocks,
            pairs, hidden, inter,
            *h.stride(), *w2.stride(), *y.stride(), *topk_weights.stride(),
            TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=d.block_n, BLOCK_K=d.block_k,
            EVEN_K=inter % d.block_k == 0, PRECISION=precision,
            num_warps=d.num_warps, num_stages=d.num_stages,
        )  # fmt: skip
    if prep == "triton":
        moe_sum(y, topk_ids, num_local, out)
    else:
        torch.sum(y.view(tokens, top_k, hidden), dim=1, out=out)
