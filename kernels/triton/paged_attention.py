"""Paged attention in Triton: queries attend to their sequence's keys and values where they
lie in the paged KV cache, read once, in place (flash attention's online softmax over
the block table). The torch path it replaces on CUDA gathered each sequence's whole
block table into a dense copy per layer, then ran SDPA on the copy (prefill also
repeated every KV head for its query heads): three passes over the KV bytes, and
allocations that grow with the context.

A program is (query tile, KV head[, key split]). Its rows are the tile's tokens times
the GROUP query heads that share the KV head (grouped-query attention: one K / V load
serves all of them), row r = token r // GROUP, head kv_head * GROUP + r % GROUP. It
walks the tile's visible keys BLOCK_N at a time: each key's block from the block table,
K [BLOCK_N, d] loaded, scores for all rows in one dot, the causal (and sliding-window)
mask, the running max / sum rescale, then P @ V in a second dot.

Decode (one query per sequence, DECODE): tile i = sequence i, its query at position
context_lens[i] - 1; everything comes from device tensors shaped by the batch, so a
decode step is captured in a CUDA graph. A decode batch with few programs for the
SMs splits each sequence's keys over several programs (flash-decoding): each writes its
unnormalised output with its max and sum, and `_combine_kernel` merges them.

Prefill (query tiles from the host): a chunk of n queries at positions
[context - n, context) is cut into tiles of BLOCK_Q tokens; tile j sees keys
[0, its last position] (from the window's start with a sliding window) — keys past the
tile are never read.

Example: Llama-3-8B (32 query heads, 8 KV heads: GROUP 4), decode of 128 sequences:
grid (128, 8), each program 16 rows of which 4 are the sequence's 4 query heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton.common import cdiv, dot_precision, next_pow2, num_sms
from kernels.triton.launch import FastLaunch

PREFILL_BLOCK_M = 64
LAUNCH = {"decode": dict(num_warps=4, num_stages=2), "prefill": dict(num_warps=4, num_stages=2)}
"""Launch options per kind (benchmarks/attention_gpu.py --sweep sets them)."""
SPLIT_MIN_KEYS = 256
"""A decode split covers at least this many keys (fewer: the merge costs more than it saves)."""
MAX_SPLITS = 16
LONGEST_FIRST = True
"""prefill_tiles orders the tiles that read the most keys first (the sweep compares)."""
UNMASKED_FULL = False
"""Key steps that every row of a tile sees whole skip the mask (benchmarks/attention_gpu.py
--sweep compares both). Off until a GPU has timed it (tested in the interpreter and
compiled for sm_90 only). 16-bit only: float32's exact dots (the correctness runs) spill
with the second loop (255 registers and a 56-byte stack in the sm_90 compile check)."""
_LOG2E = 1.4426950408889634


@triton.jit
def _attend_keys(
    q, acc, m_i, l_i, n, hi, qpos, window, qk_scale, table, k_ptr, v_ptr, kvh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d, d_mask,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """One step of the online softmax over keys [n, n + BLOCK_N): K and V loaded where the
    block table puts them, scores, running max / sum rescaled. MASKED: keys past hi, past
    a row's position or out of its window count for nothing (without it every key is
    visible to every row). -> (acc, m_i, l_i)."""
    pos = n + tl.arange(0, BLOCK_N)
    if MASKED:
        p_mask = pos < hi
        blk = tl.load(table + pos // BS, mask=p_mask, other=0).to(tl.int64)
        kv_mask = p_mask[:, None] & d_mask[None, :]
    else:
        blk = tl.load(table + pos // BS).to(tl.int64)
        kv_mask = d_mask[None, :]
    within = (pos % BS).to(tl.int64)
    k_off = blk * stride_kb + within * stride_ks + kvh * stride_kh
    k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASKED:
        visible = p_mask[None, :] & (pos[None, :] <= qpos[:, None])
        if WINDOW:
            visible &= pos[None, :] > qpos[:, None] - window
        s = tl.where(visible, s, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.where(visible, tl.exp2(s - m_new[:, None]), 0.0)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v_off = blk * stride_vb + within * stride_vs + kvh * stride_vh
    v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["num_rows", "stride_tab", "keys_per_split", "num_splits"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, ctx_ptr, tiles_ptr, part_ptr, ml_ptr,
    num_rows, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_tab,
    keys_per_split, num_splits, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DECODE: tl.constexpr, SPLIT: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    UNMASKED_FULL: tl.constexpr,
):  # fmt: skip
    """Semantics, for the tile's queries t (position p_t) and head h of KV head g:
        out[t, h] = sum_j softmax_j(scale * q[t, h] . K[j, g]) V[j, g]
    over the keys j <= p_t of the tile's sequence (and j > p_t - window with WINDOW),
    K[j] / V[j] at cache slot tables[row, j // BS] * BS + j % BS; qk_scale = scale *
    log2(e), the softmax in exp2. SPLIT: this program's share of the keys (split
    program_id(2) of num_splits, keys_per_split each), unnormalised, to part / ml
    (decode only)."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    if DECODE:
        q0 = tile
        nq = 1
        pos0 = tl.load(ctx_ptr + tile).to(tl.int32) - 1
        row = tile
    else:
        q0 = tl.load(tiles_ptr + tile * 4)
        nq = tl.load(tiles_ptr + tile * 4 + 1)
        pos0 = tl.load(tiles_ptr + tile * 4 + 2)
        row = tl.load(tiles_ptr + tile * 4 + 3)
    offs_m = tl.arange(0, BLOCK_M)
    tok = offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    m_valid = (tok < nq) & (offs_m < BLOCK_Q * GROUP)
    qpos = pos0 + tok
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q0 + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(
        q_ptr + q_rows[:, None] + offs_d[None, :],
        mask=m_valid[:, None] & d_mask[None, :],
        other=0.0,
    )
    hi = pos0 + nq  # keys [lo, hi): through the tile's last query
    lo = 0
    if WINDOW:
        lo = tl.maximum(pos0 - window + 1, 0)
    if SPLIT:
        lo = lo + tl.program_id(2) * keys_per_split
        hi = tl.minimum(hi, lo + keys_per_split)
    # -1e30, a finite "minus infinity": a row with no visible key yet stays finite (a
    # masked score's exp2 is 0 by the tl.where below, not by an inf - inf)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = tables_ptr + row.to(tl.int64) * stride_tab
    # keys below the tile's first query (and below the split's end) are visible to every
    # row: whole BLOCK_N steps of them skip the mask; the rest (the diagonal, a window's
    # edges, a context's partial last step) are masked
    full_hi = lo
    if UNMASKED_FULL and not WINDOW:
        full_hi = lo + tl.maximum(tl.minimum(hi, pos0 + 1) - lo, 0) // BLOCK_N * BLOCK_N
    for n in range(lo, full_hi, BLOCK_N):
        acc, m_i, l_i = _attend_keys(
            q, acc, m_i, l_i, n, hi, qpos, window, qk_scale, table, k_ptr, v_ptr, kvh,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d, d_mask,
            BS, BLOCK_N, False, WINDOW, PRECISION,
        )  # fmt: skip
    for n in range(full_hi, hi, BLOCK_N):
        acc, m_i, l_i = _attend_keys(
            q, acc, m_i, l_i, n, hi, qpos, window, qk_scale, table, k_ptr, v_ptr, kvh,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, offs_d, d_mask,
            BS, BLOCK_N, True, WINDOW, PRECISION,
        )  # fmt: skip
    if SPLIT:  # decode: row r < GROUP is head kvh * GROUP + r of sequence `tile`
        part_row = (tl.program_id(2) * num_rows + tile) * num_heads + head
        ml = ml_ptr + part_row.to(tl.int64) * 2
        tl.store(ml, m_i, mask=m_valid)
        tl.store(ml + 1, l_i, mask=m_valid)
        p_ptrs = part_ptr + part_row.to(tl.int64)[:, None] * BLOCK_D + offs_d[None, :]
        tl.store(p_ptrs, acc, mask=m_valid[:, None])
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_rows = (q0 + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
        o_ptrs = out_ptr + o_rows[:, None] + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_rows", "num_splits"])
def _combine_kernel(
    part_ptr, ml_ptr, out_ptr, num_rows, num_heads, stride_ot, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MAX_S: tl.constexpr,
):  # fmt: skip
    """out[t, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, M = max_s m_s: the
    decode splits of sequence t, head h merged (a split with no keys has l_s = 0)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, MAX_S)
    s_mask = offs_s < num_splits
    rows = (offs_s * num_rows + t) * num_heads + h
    m = tl.load(ml_ptr + rows.to(tl.int64) * 2, mask=s_mask, other=-1.0e30)
    l_s = tl.load(ml_ptr + rows.to(tl.int64) * 2 + 1, mask=s_mask, other=0.0)
    w = tl.exp2(m - tl.max(m, 0))
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.load(
        part_ptr + rows.to(tl.int64)[:, None] * BLOCK_D + offs_d[None, :],
        mask=s_mask[:, None],
        other=0.0,
    )
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    o_ptrs = out_ptr + t.to(tl.int64) * stride_ot + h.to(tl.int64) * stride_oh + offs_d
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


_ATTEND = FastLaunch(_paged_attention_kernel)
_COMBINE = FastLaunch(_combine_kernel)


def decode_splits(num_seqs: int, kv_heads: int, max_keys: int, device: torch.device) -> int:
    """Key splits per decode sequence: enough programs for about two per SM, each split
    at least SPLIT_MIN_KEYS keys of the longest context the batch can hold (host values
    only, so a captured decode step keeps its launch shape); a power of two."""
    programs = num_seqs * kv_heads
    want = cdiv(2 * num_sms(device), max(programs, 1))
    most = max(1, min(MAX_SPLITS, max_keys // SPLIT_MIN_KEYS))
    return min(next_pow2(want), 1 << (most.bit_length() - 1))


def prefill_tiles(
    query_lens, context_lens, block_q: int, device: torch.device, skip=None
) -> torch.Tensor:
    """int32 [tiles, 4]: (first query row, queries, position of the first, sequence) for
    each BLOCK_Q-query tile of each sequence's queries (rows one sequence after another),
    the tiles that read the most keys first: a long prompt's last tiles take the longest,
    and started last they would run on alone while the SMs the short ones left sit idle.
    skip: a flag per sequence; a flagged one gets no tiles (its rows are left unwritten)."""
    rows, start = [], 0
    skip = skip or [False] * len(query_lens)
    for i, (n, ctx, off) in enumerate(zip(query_lens, context_lens, skip, strict=True)):
        n, ctx = int(n), int(ctx)
        for j in range(0, 0 if off else n, block_q):
            rows.append((start + j, min(block_q, n - j), ctx - n + j, i))
        start += n
    if LONGEST_FIRST:
        rows.sort(key=lambda r: -(r[2] + r[1]))  # stable: ties keep their order
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 4).to(device, non_blocking=True)


@dataclass(frozen=True)
class Tiles:
    """A launch's tile shape: rows a program (BLOCK_M: query tokens x the group's heads),
    keys a step (BLOCK_N), query tokens a prefill tile (BLOCK_Q)."""

    block_m: int
    block_n: int
    block_q: int


def tile_shape(group: int, dtype: torch.dtype, head_dim: int, decode: bool) -> Tiles:
    """16-bit: decode 16 rows (one token's heads, padded for the dot) and 64 keys, prefill
    64 rows and 64 keys; float32 (exact "ieee" dots, no tensor cores: the engine's
    correctness runs) 16 rows and 32 keys, and 32 keys past a head size of 128: the
    register budget, where larger tiles spilled (tests/unit/kernels/sm90_compile.py)."""
    rows = max(16 if decode or dtype == torch.float32 else PREFILL_BLOCK_M, next_pow2(group))
    keys = 32 if dtype == torch.float32 or head_dim > 128 else 64
    return Tiles(rows, keys, 1 if decode else max(1, rows // group))


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens,
    scale: float,
    window: int | None,
    query_lens,
    out: torch.Tensor,
    tiles: torch.Tensor | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """kernels.paged_attention on Triton (arguments checked there). tiles: prefill_tiles
    for these query_lens at tile_shape's block_q, where the caller keeps them for the
    step's layers. splits: a decode's key splits (default decode_splits'; warm_up sets it)."""
    num_rows, heads, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    group = heads // kvh
    block_d = max(16, next_pow2(d))
    scalars = (
        num_rows, heads, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
    )  # fmt: skip
    qk_scale = float(scale) * _LOG2E
    win = int(window or 0)

    def constexprs(t: Tiles, decode: bool, split: bool):  # the signature's order
        return dict(
            HEAD_DIM=d, BLOCK_D=block_d, BS=bs, GROUP=group, BLOCK_Q=t.block_q,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, DECODE=decode, SPLIT=split,
            WINDOW=window is not None, PRECISION=dot_precision(q.dtype),
            UNMASKED_FULL=UNMASKED_FULL and q.dtype != torch.float32,
        )  # fmt: skip

    if query_lens is None:
        max_keys = block_tables.shape[1] * bs
        if window is not None:
            max_keys = min(max_keys, int(window))
        if splits is None:
            splits = decode_splits(num_rows, kvh, max_keys, q.device)
        t = tile_shape(group, q.dtype, d, True)
        per_split = cdiv(cdiv(max_keys, splits), t.block_n) * t.block_n
        part = ml = out
        if splits > 1:
            f32 = dict(device=q.device, dtype=torch.float32)
            part = torch.empty(splits, num_rows, heads, block_d, **f32)
            ml = torch.empty(splits, num_rows, heads, 2, **f32)
        _ATTEND(
            (num_rows, kvh, splits),
            (q, k_cache, v_cache, out, block_tables, context_lens, block_tables, part, ml),
            (*scalars, per_split, splits, qk_scale, win),
            constexprs(t, True, splits > 1),
            **LAUNCH["decode"],
        )  # fmt: skip
        if splits > 1:
            _COMBINE(
                (num_rows, heads), (part, ml, out),
                (num_rows, heads, out.stride(0), out.stride(1), splits),
                dict(HEAD_DIM=d, BLOCK_D=block_d, MAX_S=MAX_SPLITS), num_warps=4,
            )  # fmt: skip
        return out
    t = tile_shape(group, q.dtype, d, False)
    if tiles is None:
        tiles = prefill_tiles(query_lens, context_lens, t.block_q, q.device)
    if tiles.shape[0] == 0:
        return out
    _ATTEND(
        (tiles.shape[0], kvh, 1),
        (q, k_cache, v_cache, out, block_tables, tiles, tiles, out, out),
        (*scalars, 0, 1, qk_scale, win),
        constexprs(t, False, False),
        **LAUNCH["prefill"],
    )  # fmt: skip
    return out


def warm_up(
    heads: int, k_cache: torch.Tensor, windows, scale: float, table_dtype=torch.int64
) -> int:
    """Compile (or load from Triton's disk cache) every variant of the kernels a model's
    steps launch, on a tiny batch in k_cache's layout: decode without and with key splits
    (and their merge), prompt chunks; for each distinct sliding window of the model's
    layers (None: full attention). Without it, the first step to need a variant compiles
    it mid-serving: ~1-2 s (a 32 x 1024 decode run on an H100 stalled 2.3 s when its
    batch first took key splits). Nothing is written to k_cache. -> variants launched."""
    _, bs, kvh, d = k_cache.shape
    dev, dtype = k_cache.device, k_cache.dtype
    cache = torch.zeros(2, bs, kvh, d, dtype=dtype, device=dev)
    tables = torch.zeros(1, 2, dtype=table_dtype, device=dev)
    q = torch.zeros(1, heads, d, dtype=dtype, device=dev)
    out = torch.empty_like(q)
    ctx = torch.ones(1, dtype=torch.int64, device=dev)
    launched = 0
    for window in sorted(set(windows), key=lambda w: -1 if w is None else w):
        for splits in (1, 2):
            paged_attention_triton(q, cache, cache, tables, ctx, scale, window, None, out,
                                   splits=splits)  # fmt: skip
            launched += 1
        paged_attention_triton(q, cache, cache, tables, [1], scale, window, [1], out)
        launched += 1
    return launched
