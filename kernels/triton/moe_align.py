"""kernels.moe_align's alignment on the device in TWO launches (the torch build is a dozen).

The T * k pairs are cut into NC chunks of C pairs (`plan`), one program per chunk
in both launches; a program walks its chunk in steps of S pairs. A pair's key is its
expert id when that is in [0, E), else EP (another rank's pair, or a lane past the last
pair): no row. EP is E rounded up to a power of two, at least 16.

    launch 1 (_count_kernel), chunk c:
        sorted_ids[c's stripe] = P (the padding id, P = T * k)
        counts[c, e] = #{pairs of chunk c with key e}, e < EP   (scratch int32 [NC, EP])
    launch 2 (_place_kernel), chunk c, from every chunk's counts:
        total[e] = sum_c' counts[c', e];  before[e] = sum_{c' < c} counts[c', e]
        blocks[e] = ceil(total[e] / BLOCK_M);  block_end = cumsum(blocks)
        row_start[e] = (block_end[e] - blocks[e]) * BLOCK_M
        pair p of chunk c with key e, the q-th pair of key e in its chunk (0-based,
        by pair id; from the running count of each key over the chunk's earlier steps
        and an S x S comparison inside a step):
            sorted_ids[row_start[e] + before[e] + q] = p
        block_expert[b] = #{e < E: block_end[e] <= b} over c's stripe of blocks
        num_blocks = block_end[EP - 1] (chunk 0)

Pairs of one expert keep token-major order: chunks, steps and lanes all go in pair order.
Only loads, stores, sums and cumsums: no atomics (deterministic), and no tl.sort, which
the interpreter of the CPU tests runs element by element in Python.

Worked example (kernels/moe_align.py's: topk_ids [[0, 5], [1, 0], [0, 1]], E 2, BLOCK_M 2,
so P 6; here with C 4 for two chunks, where `plan` takes one of 16):
    keys: chunk 0 [0, 16, 1, 0], chunk 1 [0, 1, 16, 16];  counts [[2, 1], [1, 1]]
    total [3, 2], blocks [2, 1], block_end [2, 3], row_start [0, 4]
    chunk 0, before [0, 0]: pairs 0, 3 (q 0, 1) -> rows 0, 1; pair 2 -> row 4
    chunk 1, before [2, 1]: pair 4 -> row 0 + 2 = 2; pair 5 -> row 4 + 1 = 5
    sorted_ids [0, 3, 4, 6, 2, 5, 6, 6]; block_expert [0, 0, 1, 2]; num_blocks [3]
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.moe_align import MoeAlignment, align_moe_ref, max_blocks
from kernels.triton.common import cdiv, next_pow2

MAX_EXPERTS = 1024
"""Larger expert counts take the torch alignment (the kernels hold [EP] vectors)."""
TARGET_CHUNKS = 64
"""Programs aimed at: the prefix over chunks costs each program NC x EP loads."""
MAX_CHUNK = 4096
"""Most pairs per program (past TARGET_CHUNKS * MAX_CHUNK pairs, more chunks instead)."""
FILL_BLOCK = 1024
"""Elements per store of the padding fill."""
TILE = 8192
"""Elements of a [rows, EP] tile (one-hot keys, counts, block ends) per loop step (8
rows at MAX_EXPERTS)."""


@dataclass(frozen=True)
class AlignPlan:
    """The launches' shape for (pairs, E, blocks): NC programs and each kernel's constexprs."""

    chunks: int
    count: dict[str, int]
    place: dict[str, int]


@functools.lru_cache(maxsize=256)
def plan(pairs: int, num_experts: int, blocks: int, top_k: int) -> AlignPlan:
    """EP = E rounded up to a power of two, at least 16; S pairs per step, as many as an
    [S, EP] tile of TILE elements holds (at most 64: the [S, S] comparison) and no more
    than there are pairs (at least 16); C about pairs / TARGET_CHUNKS, at least one step,
    at most MAX_CHUNK; RT chunks' counts and BT blocks per loop step of launch 2, a TILE
    at most (all powers of two). Cached: a decode step asks for the same few plans."""
    ep = max(16, next_pow2(num_experts))
    step = min(64, TILE // ep, max(16, next_pow2(pairs)))
    chunk = min(MAX_CHUNK, max(step, next_pow2(cdiv(pairs, TARGET_CHUNKS))))
    chunks = cdiv(pairs, chunk)
    common = dict(TOP_K=top_k, C=chunk, S=step, EP=ep)
    rows = TILE // ep
    return AlignPlan(
        chunks=chunks,
        count=dict(common, FB=FILL_BLOCK),
        place=dict(
            common, RT=min(next_pow2(chunks), rows), BT=min(next_pow2(cdiv(blocks, chunks)), rows)
        ),
    )


@triton.jit
def _keys(ids_ptr, pair, stride_t, stride_k, P, E, EP: tl.constexpr, TOP_K: tl.constexpr):
    """Key of each pair: its expert id if in [0, E), else EP (no row; also past P)."""
    tok = (pair // TOP_K).to(tl.int64)
    ids = tl.load(ids_ptr + tok * stride_t + (pair % TOP_K) * stride_k, mask=pair < P, other=-1)
    return tl.where((ids >= 0) & (ids < E), ids, EP).to(tl.int32)


@triton.jit
def _count_kernel(
    ids_ptr, counts_ptr, sorted_ptr, stride_t, stride_k, P, E, NC, ROWS,
    TOP_K: tl.constexpr, C: tl.constexpr, S: tl.constexpr, EP: tl.constexpr,
    FB: tl.constexpr,
):  # fmt: skip
    """Launch 1 (module docstring): chunk c's stripe of the padding fill, counts[c]."""
    c = tl.program_id(0)
    stripe = (ROWS + NC - 1) // NC
    offs = tl.arange(0, FB)
    for r0 in range(0, stripe, FB):
        r = c * stripe + r0 + offs
        in_stripe = (r0 + offs < stripe) & (r < ROWS)
        tl.store(sorted_ptr + r, tl.full((FB,), P, tl.int32), mask=in_stripe)
    e = tl.arange(0, EP)
    count = tl.zeros((EP,), dtype=tl.int32)
    for s0 in range(0, C, S):
        key = _keys(ids_ptr, c * C + s0 + tl.arange(0, S), stride_t, stride_k, P, E, EP, TOP_K)
        count += tl.sum((key[:, None] == e[None, :]).to(tl.int32), 0)
    tl.store(counts_ptr + c * EP + e, count)


@triton.jit
def _place_kernel(
    ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, num_blocks_ptr,
    stride_t, stride_k, P, E, BM, NC, MB,
    TOP_K: tl.constexpr, C: tl.constexpr, S: tl.constexpr, EP: tl.constexpr,
    RT: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """Launch 2 (module docstring): chunk c's rows of sorted_ids, its stripe of
    block_expert, and num_blocks (chunk 0). RT chunks / BT blocks per loop step."""
    c = tl.program_id(0)
    e = tl.arange(0, EP)
    total = tl.zeros((EP,), dtype=tl.int32)
    before = tl.zeros((EP,), dtype=tl.int32)
    for r0 in range(0, NC, RT):
        r = r0 + tl.arange(0, RT)
        tile = tl.load(counts_ptr + r[:, None] * EP + e[None, :], mask=(r < NC)[:, None], other=0)
        total += tl.sum(tile, 0)
        before += tl.sum(tl.where((r < c)[:, None], tile, 0), 0)
    blocks = (total + BM - 1) // BM
    block_end = tl.cumsum(blocks, 0)
    next_row = (block_end - blocks) * BM + before  # row of each key's next pair
    lane = tl.arange(0, S)
    earlier = lane[None, :] < lane[:, None]  # [i, j]: lane j precedes lane i
    for s0 in range(0, C, S):
        pair = c * C + s0 + lane
        key = _keys(ids_ptr, pair, stride_t, stride_k, P, E, EP, TOP_K)
        hit = key[:, None] == e[None, :]  # [S, EP]
        same = tl.sum((earlier & (key[:, None] == key[None, :])).to(tl.int32), 1)
        row = tl.sum(tl.where(hit, next_row[None, :], 0), 1) + same
        tl.store(sorted_ptr + row, pair, mask=key < E)
        next_row += tl.sum(hit.to(tl.int32), 0)
    stripe = (MB + NC - 1) // NC
    ends = tl.where(e < E, block_end, MB + 1)  # no block reaches a padded expert's end
    for b0 in range(0, stripe, BT):
        b = c * stripe + b0 + tl.arange(0, BT)
        expert = tl.sum((ends[None, :] <= b[:, None]).to(tl.int32), 1)
        tl.store(block_expert_ptr + b, expert, mask=(b0 + tl.arange(0, BT) < stripe) & (b < MB))
    if c == 0:
        tl.store(num_blocks_ptr, tl.sum(blocks, 0))


def align_moe_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """kernels.moe_align.align_moe in two launches (arguments checked by it); the same
    tensors bit for bit, no host sync, sizes from (T, k, E, block_m) only: CUDA-graph
    capturable. More than MAX_EXPERTS experts take the torch build."""
    if num_experts > MAX_EXPERTS:
        return align_moe_ref(topk_ids, num_experts, block_m)
    tokens, top_k = topk_ids.shape
    pairs = tokens * top_k
    blocks = max_blocks(pairs, num_experts, block_m)
    dev = topk_ids.device
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
    if pairs == 0:
        num_blocks = torch.zeros(1, dtype=torch.int32, device=dev)
        return MoeAlignment(sorted_ids, block_expert, num_blocks, block_m)
    num_blocks = torch.empty(1, dtype=torch.int32, device=dev)
    p = plan(pairs, num_experts, blocks, top_k)
    counts = torch.empty(p.chunks, p.count["EP"], dtype=torch.int32, device=dev)
    _count_kernel[(p.chunks,)](
        topk_ids, counts, sorted_ids, *topk_ids.stride(), pairs, num_experts, p.chunks,
        blocks * block_m, **p.count,
    )  # fmt: skip
    _place_kernel[(p.chunks,)](
        topk_ids, counts, sorted_ids, block_expert, num_blocks, *topk_ids.stride(), pairs,
        num_experts, block_m, p.chunks, blocks, **p.place,
    )  # fmt: skip
    return MoeAlignment(sorted_ids, block_expert, num_blocks, block_m)
