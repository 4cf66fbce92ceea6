"""SegmentMeta on the device in ONE launch of ONE program: a stable radix sort by slot.

The torch build is about 20 small kernels; under CUDA-graph replay their launch gaps
dominate a decode step's metadata. Here one program sorts the tokens by slot with an
LSD radix sort, 2 key bits per pass, through scratch memory (the 8T bytes of
out.token_slots, written last). A pass costs two prefix sums over the tokens whatever
the number of slots L, and there are ceil(bits(L) / 2) passes (4 for L = 128); a last
pass over the sorted tokens lays out the tiles.

    v_t = key_t << LOG_TP | t,   key_t = slot_t if 0 <= slot_t < L else L (sorts last)
    radix pass p (digit d_t = key bits 2p, 2p + 1), over chunks of CT tokens in order:
        dst[start_d + (earlier tokens with digit d)] = v_t               (stable)
        the 4 digit counters are 16-bit fields of two int32 words: 2 prefix sums
    tile pass over sorted positions i (key k, token t), in chunks:
        runs[r] = first position of run r (one key's tokens);  q = i - runs[run of i]
        q % BM == 0 opens a tile: tile = (tiles opened at or before i) - 1
        tile_tok[tile, q % BM] = t;  tile_slot[tile] = k;  tile_rank[tile] = ranks[k]

Worked example (kernels.meta's): token_slots = [2, -1, 0, 2, 2], L = 3 (2 key bits,
one pass), BM = 2, T = 5 (CT = 32 lanes, LOG_TP = 5).
    key = [2, 3, 0, 2, 2]; digit counts [1, 0, 3, 1] -> starts [0, 1, 1, 4]
    sorted (key, t) = (0, 2) (2, 0) (2, 3) (2, 4) (3, 1); runs = [0, 1, 4]
    q = 0, 0, 1, 2, 0; keys < 3 with q % 2 == 0 open tiles 0, 1, 2 at i = 0, 1, 3
    tile_tok = [[2, -1], [0, 3], [4, -1], -1...]; tile_slot = [0, 2, 2, -1...]; num_tiles 3
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.meta import FULL_RANK, SegmentMeta, _build_torch
from kernels.triton.common import next_pow2

MAX_CHUNK = 4096
"""Tokens per scan (CT): one chunk covers every decode and most prefill steps."""
MAX_TOKENS = 2**16 - 1
"""Digit counts are 16-bit fields; longer slot maps take the torch build."""
FILL_BLOCK = 1024
"""Elements per store of the -1 / 0 fills and the slot-map copy."""


@triton.jit
def _lanes(CT: tl.constexpr):
    """int32 [CT // 32, 32]: 0 .. CT - 1 row-major. Chunks are 2-D so that a prefix sum is a
    scan along rows plus one scan of the row totals (a third of a 1-D tl.cumsum's code)."""
    return tl.arange(0, CT // 32)[:, None] * 32 + tl.arange(0, 32)[None, :]


@triton.jit
def _scan(x):
    """x: int32 [R, 32] -> (inclusive prefix sum in row-major order, total)."""
    rows = tl.sum(x, 1)
    before = tl.cumsum(rows, 0) - rows
    return tl.cumsum(x, 1) + before[:, None], tl.sum(rows, 0)


@triton.jit
def _packed(src_ptr, slots_ptr, stride_t, t, mask, L, FIRST: tl.constexpr, LOG_TP: tl.constexpr):
    """v of tokens t: key << LOG_TP | t from the slot map (FIRST), else loaded from src."""
    if FIRST:
        slot = tl.load(slots_ptr + t.to(tl.int64) * stride_t, mask=mask, other=-1)
        key = tl.where((slot >= 0) & (slot < L), slot, L).to(tl.int32)
        return (key << LOG_TP) | t
    return tl.load(src_ptr + t, mask=mask, other=0)


@triton.jit
def _field(lo, hi, d):
    """Field d of 4 16-bit counters packed in two int32 words (digits 0, 1 in lo; 2, 3 in hi)."""
    return (tl.where(d < 2, lo, hi) >> (16 * (d & 1))) & 0xFFFF


@triton.jit
def _digits(v, mask, SHIFT: tl.constexpr, LOG_TP: tl.constexpr):
    """v: [R, 32] -> (d: key bits SHIFT, SHIFT + 1; rank: mask lanes before with the same d,
    row-major; counts lo, hi: the mask lanes' count of each digit, as in _field).

    One word counts all 4 digits: 8-bit fields along a row (at most 32), then 16-bit
    fields (two words) across rows.
    """
    d = (v >> (LOG_TP + SHIFT)) & 3
    one = tl.where(mask, 1 << (8 * d), 0)
    rows = tl.sum(one, 1)
    lo = (rows & 0xFF) | ((rows & 0xFF00) << 8)
    hi = ((rows >> 16) & 0xFF) | ((rows >> 8) & 0xFF0000)
    lo_before = tl.cumsum(lo, 0) - lo
    hi_before = tl.cumsum(hi, 0) - hi
    in_row = (tl.cumsum(one, 1) >> (8 * d)) & 0xFF
    rank = in_row + _field(lo_before[:, None], hi_before[:, None], d) - 1
    return d, rank, tl.sum(lo, 0), tl.sum(hi, 0)


@triton.jit
def _exclusive(lo, hi):
    """Packed digit counts -> packed starts: field d = sum of fields < d (all < 2**16)."""
    c0 = lo & 0xFFFF
    c01 = c0 + ((lo >> 16) & 0xFFFF)
    return c0 << 16, c01 + ((c01 + (hi & 0xFFFF)) << 16)


@triton.jit
def _radix_pass(src_ptr, dst_ptr, slots_ptr, stride_t, T, L, FIRST: tl.constexpr,
                SHIFT: tl.constexpr, LOG_TP: tl.constexpr, CT: tl.constexpr,
                ONE_CHUNK: tl.constexpr):  # fmt: skip
    """dst[0:T] = src[0:T] (or the packed slot map when FIRST) stably sorted by key digit
    SHIFT; ends with a barrier, so dst is complete and src free for the next pass."""
    lane = _lanes(CT)
    if ONE_CHUNK:
        v = _packed(src_ptr, slots_ptr, stride_t, lane, lane < T, L, FIRST, LOG_TP)
        d, rank, lo, hi = _digits(v, lane < T, SHIFT, LOG_TP)
        start_lo, start_hi = _exclusive(lo, hi)
        tl.store(dst_ptr + _field(start_lo, start_hi, d) + rank, v, mask=lane < T)
    else:
        lo = 0
        hi = 0
        for t0 in range(0, T, CT):
            v = _packed(src_ptr, slots_ptr, stride_t, t0 + lane, t0 + lane < T, L, FIRST, LOG_TP)
            _, _, chunk_lo, chunk_hi = _digits(v, t0 + lane < T, SHIFT, LOG_TP)
            lo += chunk_lo
            hi += chunk_hi
        run_lo, run_hi = _exclusive(lo, hi)  # field d: where the next token of digit d goes
        for t0 in range(0, T, CT):
            v = _packed(src_ptr, slots_ptr, stride_t, t0 + lane, t0 + lane < T, L, FIRST, LOG_TP)
            d, rank, chunk_lo, chunk_hi = _digits(v, t0 + lane < T, SHIFT, LOG_TP)
            tl.store(dst_ptr + _field(run_lo, run_hi, d) + rank, v, mask=t0 + lane < T)
            run_lo += chunk_lo
            run_hi += chunk_hi
    tl.debug_barrier()


@triton.jit
def _tile_pass(sorted_ptr, runs_ptr, ranks_ptr, stride_r, tile_slot_ptr, tile_rank_ptr,
               tile_tok_ptr, T, L, FULL: tl.constexpr, HAS_RANKS: tl.constexpr,
               BM: tl.constexpr, LOG_TP: tl.constexpr, CT: tl.constexpr):  # fmt: skip
    """Token rows and opened tiles from the sorted values -> num_tiles.

    A run is the sorted tokens of one key; runs_ptr (T free int32) holds each run's first
    position, so q = position - runs[run] is a token's rank inside its slot.
    """
    num_tiles = 0
    num_runs = 0
    for i0 in range(0, T, CT):
        i = i0 + _lanes(CT)
        v = tl.load(sorted_ptr + i, mask=i < T, other=0)
        before = tl.load(sorted_ptr + i - 1, mask=(i > 0) & (i < T), other=-1)
        key = v >> LOG_TP
        first = (i < T) & ((i == 0) | ((before >> LOG_TP) != key))
        run, count = _scan(first.to(tl.int32))
        run += num_runs - 1
        tl.store(runs_ptr + run, i, mask=first)
        tl.debug_barrier()  # each run's first position is stored before it is read
        q = i - tl.load(runs_ptr + run, mask=i < T, other=0)
        valid = (i < T) & (key < L)
        opens = valid & (q % BM == 0)
        tile, opened = _scan(opens.to(tl.int32))
        tile += num_tiles - 1
        tl.store(tile_tok_ptr + tile * BM + q % BM, v & ((1 << LOG_TP) - 1), mask=valid)
        if HAS_RANKS:
            rank = tl.load(ranks_ptr + key * stride_r, mask=opens, other=0).to(tl.int32)
        else:
            rank = tl.full(v.shape, FULL, tl.int32)
        tl.store(tile_slot_ptr + tile, key, mask=opens)
        tl.store(tile_rank_ptr + tile, rank, mask=opens)
        num_tiles += opened
        num_runs += count
    return num_tiles


@triton.jit
def _fill(ranks_ptr, stride_r, out_ranks_ptr, tile_tok_ptr, sync_ptr, L, MT,
          FULL: tl.constexpr, HAS_RANKS: tl.constexpr, BM: tl.constexpr,
          FB: tl.constexpr):  # fmt: skip
    """tile_tok = -1 (the tile pass overwrites token rows after the radix barriers),
    sync = 0, out ranks = ranks (FULL without ranks)."""
    offs = tl.arange(0, FB)
    for i0 in range(0, MT * BM, FB):
        tl.store(tile_tok_ptr + i0 + offs, tl.full((FB,), -1, tl.int32), mask=i0 + offs < MT * BM)
    for i0 in range(0, MT + 1, FB):
        tl.store(sync_ptr + i0 + offs, tl.zeros((FB,), dtype=tl.int32), mask=i0 + offs <= MT)
    for l0 in range(0, L, FB):
        slot = l0 + offs
        if HAS_RANKS:
            ranks = tl.load(ranks_ptr + slot * stride_r, mask=slot < L, other=0).to(tl.int32)
        else:
            ranks = tl.full((FB,), FULL, tl.int32)
        tl.store(out_ranks_ptr + slot, ranks, mask=slot < L)


@triton.jit
def _finish(slots_ptr, stride_t, out_slots_ptr, tile_slot_ptr, tile_rank_ptr, num_tiles, T, MT,
            FB: tl.constexpr):  # fmt: skip
    """Tiles past num_tiles = (-1, 0); then out.token_slots = slots as int64 (its memory
    was the scratch: the barrier keeps the copy after the last scratch read)."""
    offs = tl.arange(0, FB)
    for i0 in range(0, MT, FB):
        tail = (i0 + offs >= num_tiles) & (i0 + offs < MT)
        tl.store(tile_slot_ptr + i0 + offs, tl.full((FB,), -1, tl.int32), mask=tail)
        tl.store(tile_rank_ptr + i0 + offs, tl.zeros((FB,), dtype=tl.int32), mask=tail)
    tl.debug_barrier()
    for t0 in range(0, T, FB):
        t = t0 + offs
        slot = tl.load(slots_ptr + t.to(tl.int64) * stride_t, mask=t < T)
        tl.store(out_slots_ptr + t, slot.to(tl.int64), mask=t < T)


@triton.jit
def _build_meta_kernel(
    slots_ptr, ranks_ptr, scratch_ptr, out_slots_ptr, out_ranks_ptr, tile_slot_ptr,
    tile_rank_ptr, tile_tok_ptr, num_tiles_ptr, sync_ptr, stride_t, stride_r, T, L, MT,
    FULL: tl.constexpr, HAS_RANKS: tl.constexpr, BM: tl.constexpr, PASSES: tl.constexpr,
    LOG_TP: tl.constexpr, CT: tl.constexpr, ONE_CHUNK: tl.constexpr, FB: tl.constexpr,
):  # fmt: skip
    """All of SegmentMeta in one program (kernels.meta._build_torch is the reference).

    Semantics:
        key_t = slot_t if 0 <= slot_t < L else L;  tiles_l = ceil(|{t: key_t = l}| / BM)
        tiles of slot l: tile_begin_l .. tile_begin_l + tiles_l - 1 (slot order)
        tile_tok[tile_begin_l + q // BM, q % BM] = t, for the q-th token t of slot l
        tile_slot/tile_rank = l / ranks[l] on slot l's tiles, -1 / 0 past num_tiles
        tile_tok = -1 elsewhere; num_tiles = sum_l tiles_l; sync = 0
        out slots = slots (int64); out ranks = ranks (FULL when HAS_RANKS is False)
    scratch: int32 [2T], the memory of out slots; pass p writes half p % 2.
    """
    _fill(ranks_ptr, stride_r, out_ranks_ptr, tile_tok_ptr, sync_ptr, L, MT,
          FULL, HAS_RANKS, BM, FB)  # fmt: skip
    for p in tl.static_range(PASSES):
        _radix_pass(scratch_ptr + ((p + 1) % 2) * T, scratch_ptr + (p % 2) * T, slots_ptr,
                    stride_t, T, L, p == 0, 2 * p, LOG_TP, CT, ONE_CHUNK)  # fmt: skip
    num_tiles = _tile_pass(
        scratch_ptr + ((PASSES - 1) % 2) * T, scratch_ptr + (PASSES % 2) * T, ranks_ptr,
        stride_r, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, T, L, FULL, HAS_RANKS, BM,
        LOG_TP, CT,
    )  # fmt: skip
    tl.store(num_tiles_ptr, num_tiles)
    _finish(slots_ptr, stride_t, out_slots_ptr, tile_slot_ptr, tile_rank_ptr, num_tiles, T, MT,
            FB)  # fmt: skip


def build_meta_triton(
    token_slots: torch.Tensor, slot_ranks: torch.Tensor | None, out: SegmentMeta
) -> None:
    """token_slots: int32/int64 [T]; slot_ranks: int [L] or None; fills `out` (built for
    (T, L)) exactly as kernels.meta._build_torch does. One launch, no host sync: CUDA-graph
    capturable."""
    tokens, num_slots = out.num_tokens, out.num_slots
    ct = max(32, min(next_pow2(tokens), MAX_CHUNK))
    log_tp = max(ct, next_pow2(tokens)).bit_length() - 1
    key_bits = num_slots.bit_length()  # keys 0..L, L = no adapter
    if tokens > MAX_TOKENS or key_bits + log_tp > 31:
        _build_torch(token_slots, slot_ranks, out)
        return
    if token_slots.untyped_storage().data_ptr() == out.token_slots.untyped_storage().data_ptr():
        token_slots = token_slots.clone()  # out.token_slots is the kernel's scratch
    has_ranks = slot_ranks is not None
    ranks = slot_ranks if has_ranks else out.slot_ranks
    _build_meta_kernel[(1,)](
        token_slots, ranks, out.token_slots.view(torch.int32), out.token_slots, out.slot_ranks,
        out.tile_slot, out.tile_rank, out.tile_tok, out.num_tiles, out.sync,
        token_slots.stride(0), ranks.stride(0), tokens, num_slots, out.max_tiles,
        FULL=FULL_RANK, HAS_RANKS=has_ranks, BM=out.block_m, PASSES=-(-key_bits // 2),
        LOG_TP=log_tp, CT=ct, ONE_CHUNK=tokens <= ct, FB=FILL_BLOCK,
        num_warps=_num_warps(ct),
    )  # fmt: skip


def _num_warps(ct: int) -> int:
    """About 8 tokens per thread, 4 to 16 warps."""
    return min(16, max(4, ct // 256))
