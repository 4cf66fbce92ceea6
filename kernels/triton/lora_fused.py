"""Fused segmented LoRA: y (+)= expand(shrink(x)) for all slices and adapters in ONE launch.

A persistent grid of P programs (all resident at once: P <= SMs x occupancy) works
through two static lists of work items, program p taking items p, p + P, ...:

    shrink items (tile, slice group g, k-split j), tile-major:
        part[j, s, tile rows, :] = scale * x[tok, k-split j] @ A_s[slot, :rank, k-split j]^T
        then flags[tile] += 1 (release)
    expand items (tile, column chunk c of slice s):
        wait until flags[tile] == groups * splits (acquire)
        h = sum_j part[j, s, tile rows, :]           (fixed order: deterministic)
        y[tok, chunk c] (+)= h @ B_s[slot, chunk c, :rank]^T

An expand item waits only for shrink items of its own tile, which sit earlier in every
program's list; since all P programs are resident, every awaited item is running. The
partial sums go to a scratch buffer with plain stores: no zeroed output (no memset
node), no float atomics. `sync` (SegmentMeta) holds the flags and a finished-programs
counter; the last program to finish zeroes them for the next launch.

Worked example (qkv r16, T=64 decode tokens of 8 adapters, BLOCK_M 16: 8 tiles; split
16, slices fused): 8 x 1 x 16 = 128 shrink items of 256 columns of H and 8 x 48 = 384
expand items of one 128-column tile; 144 registers and 64 KB of shared memory allow 3
programs per SM, so P = 396 on the H200's 132 SMs.

Status: opt-in (FUSED_MAX_TOKENS). On the H200 it beats the separate kernels only when
tiles are few (one or a few adapters per step, r64 prefill); with many adapters each
program's items run one after another as chains of dependent memory round trips, and it
loses (benchmarks/README.md). kernels.lora_shrink_expand uses it for steps of at most
FUSED_MAX_TOKENS tokens (env LORAFLEET_FUSED_MAX_TOKENS, default 0).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.meta import SegmentMeta
from kernels.triton.common import as_meta, block_r, cdiv, dot_precision, next_pow2, num_sms
from kernels.triton.lora_expand import check_y_b
from kernels.triton.lora_shrink import check_x_a
from kernels.triton.tiles import expand_block, load_tile, pick, shrink_acc


@triton.jit
def _shrink_items(
    x_ptr, a_ptr, part_ptr, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, sync_ptr,
    num_tiles, pid, num_programs, a_off1, a_off2,
    stride_xt, stride_xh, stride_al, stride_ar, stride_ah,
    H, R, k_per_split, scale, part_rows,
    SPLIT: tl.constexpr, NS: tl.constexpr, NSL: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    NG: tl.constexpr = NS // NSL
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    for item in range(pid, num_tiles * (NG * SPLIT), num_programs):
        tile = item // (NG * SPLIT)
        g = (item // SPLIT) % NG
        j = item % SPLIT
        slot, rank, tok, m_mask = load_tile(
            tile, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, R, BLOCK_M
        )
        a_slot = a_ptr + slot.to(tl.int64) * stride_al + pick(g, 0, a_off1, a_off2).to(tl.int64)
        acc0, acc1, acc2 = shrink_acc(
            x_ptr, a_slot, a_off1.to(tl.int64), a_off2.to(tl.int64), tok, m_mask,
            offs_r < rank, j.to(tl.int64) * k_per_split, k_per_split,
            stride_xt, stride_xh, stride_ar, stride_ah, H,
            NSL, BLOCK_M, BLOCK_R, BLOCK_K, EVEN_K, PRECISION,
        )  # fmt: skip
        # part: [SPLIT, NS, part_rows, BLOCK_R] fp32, row tile * BLOCK_M + m
        row = (j * NS + g * NSL).to(tl.int64) * part_rows + tile * BLOCK_M + offs_m
        p = part_ptr + row[:, None] * BLOCK_R + offs_r[None, :]
        tl.store(p, acc0 * scale)
        if NSL > 1:
            tl.store(p + part_rows * BLOCK_R, acc1 * scale)
        if NSL > 2:
            tl.store(p + 2 * part_rows * BLOCK_R, acc2 * scale)
        tl.debug_barrier()  # every thread's partials are written before the release
        tl.atomic_add(sync_ptr + tile, 1, sem="release")


@triton.jit
def _expand_items(
    y_ptr, b_ptr, part_ptr, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, sync_ptr,
    num_tiles, pid, num_programs, b_off1, b_off2, stride_bl0, stride_bl1, stride_bl2,
    stride_bn0, stride_bn1, stride_bn2, stride_br0, stride_br1, stride_br2,
    stride_yt, stride_yn, n0, n1, n2, ch1, ch2, chunks, R, part_rows,
    NB, SPLIT: tl.constexpr, NS: tl.constexpr, NSL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    ADD_INPUTS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    need = (NS // NSL) * SPLIT
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    for item in range(pid, num_tiles * chunks, num_programs):
        tile = item // chunks
        c = item % chunks
        s = (c >= ch1).to(tl.int32) + (c >= ch2).to(tl.int32)
        slot, rank, tok, m_mask = load_tile(
            tile, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, R, BLOCK_M
        )
        r_mask = offs_r < rank
        b_slot = (
            b_ptr
            + pick(s, 0, b_off1, b_off2).to(tl.int64)
            + slot.to(tl.int64) * pick(s, stride_bl0, stride_bl1, stride_bl2).to(tl.int64)
        )
        stride_bn = pick(s, stride_bn0, stride_bn1, stride_bn2)
        stride_br = pick(s, stride_br0, stride_br1, stride_br2)
        n_s = pick(s, n0, n1, n2)
        col0 = pick(s, 0, n0, n0 + n1).to(tl.int64)
        n_first = (c - pick(s, 0, ch1, ch2)) * (NB * BLOCK_N)
        while tl.atomic_add(sync_ptr + tile, 0, sem="acquire") < need:
            pass
        h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        row = s.to(tl.int64) * part_rows + tile * BLOCK_M + offs_m
        # Unrolled: the SPLIT loads are independent and in flight together (a loop would
        # wait out one L2 round trip per split). .cg: from L2, never a stale L1 line.
        for j in tl.static_range(SPLIT):
            p = part_ptr + (row + j * NS * part_rows)[:, None] * BLOCK_R + offs_r[None, :]
            h += tl.load(p, cache_modifier=".cg")
        h = h.to(b_ptr.dtype.element_ty)
        for nb in range(NB):
            offs_n = n_first + nb * BLOCK_N + tl.arange(0, BLOCK_N)
            expand_block(
                y_ptr, h, b_slot, tok, m_mask, r_mask, col0, offs_n, offs_n < n_s,
                stride_bn, stride_br, stride_yt, stride_yn, BLOCK_R, ADD_INPUTS, PRECISION,
            )  # fmt: skip


@triton.jit
def _fused_kernel(
    x_ptr, a_ptr, b_ptr, y_ptr, part_ptr,
    tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, num_tiles_ptr, sync_ptr, max_tiles, num_programs,
    a_off1, a_off2, b_off1, b_off2,
    stride_xt, stride_xh, stride_al, stride_ar, stride_ah,
    stride_bl0, stride_bl1, stride_bl2, stride_bn0, stride_bn1, stride_bn2,
    stride_br0, stride_br1, stride_br2, stride_yt, stride_yn,
    n0, n1, n2, ch1, ch2, chunks, H, R, k_per_split, scale, NB,
    SPLIT: tl.constexpr, NS: tl.constexpr, NSL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_K: tl.constexpr, ADD_INPUTS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Semantics (module docstring): for t with slot_t >= 0, s < NS:
    y[t, off_s:off_s+N_s] = (y[...] if ADD_INPUTS else 0)
                            + B_s[slot_t, :, :rank] @ (scale * A_s[slot_t, :rank] @ x[t])
    """
    pid = tl.program_id(0)
    num_tiles = tl.load(num_tiles_ptr)
    part_rows = max_tiles * BLOCK_M
    _shrink_items(
        x_ptr, a_ptr, part_ptr, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, sync_ptr,
        num_tiles, pid, num_programs, a_off1, a_off2,
        stride_xt, stride_xh, stride_al, stride_ar, stride_ah,
        H, R, k_per_split, scale, part_rows, SPLIT,
        NS, NSL, BLOCK_M, BLOCK_R, BLOCK_K, EVEN_K, PRECISION,
    )  # fmt: skip
    _expand_items(
        y_ptr, b_ptr, part_ptr, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, sync_ptr,
        num_tiles, pid, num_programs, b_off1, b_off2, stride_bl0, stride_bl1, stride_bl2,
        stride_bn0, stride_bn1, stride_bn2, stride_br0, stride_br1, stride_br2,
        stride_yt, stride_yn, n0, n1, n2, ch1, ch2, chunks, R, part_rows,
        NB, SPLIT, NS, NSL, BLOCK_M, BLOCK_R, BLOCK_N, ADD_INPUTS, PRECISION,
    )  # fmt: skip
    # The last program out resets the flags and the counter (every flag read is done).
    if tl.atomic_add(sync_ptr + max_tiles, 1, sem="acq_rel") == num_programs - 1:
        for t0 in range(0, max_tiles + 1, 256):
            offs = t0 + tl.arange(0, 256)
            tl.store(sync_ptr + offs, tl.zeros((256,), dtype=tl.int32), mask=offs <= max_tiles)


@dataclass(frozen=True)
class FusedTuning:
    """How much work each program gets (benchmarks may set TUNING_OVERRIDE to sweep it)."""

    shrink_items_per_program: float
    """K splits are chosen so that (tiles x groups x splits) is about this many items per program."""
    expand_items_per_program: float
    """Column chunks are chosen so that (tiles x chunks) is about this many items per program."""
    block_n: int = 128
    """Output columns per expand step (64 for ranks above 64)."""
    num_warps: int = 4
    num_stages: int = 3
    block_k: int = 0
    """H columns per shrink step; 0 picks by shared memory (256 decode, 128 prefill, halved to fit)."""
    fuse_slices: bool = True
    """One shrink item computes every slice (x read once) while S x BLOCK_R <= 64 (their
    accumulators and A tiles fit in registers; qkv at rank 64 spilled)."""
    max_programs_per_sm: int = 4
    """Cap on resident programs per SM (the launch takes min(this, occupancy))."""


TUNING: dict[str, FusedTuning] = {
    "decode": FusedTuning(shrink_items_per_program=1.0, expand_items_per_program=1.0),
    "prefill": FusedTuning(shrink_items_per_program=2.0, expand_items_per_program=4.0),
}
TUNING_OVERRIDE: FusedTuning | None = None


# Steps of at most this many tokens take the fused kernel in kernels.lora_shrink_expand.
# 0 by default: on the H200 the separate shrink + expand were faster in the engine (decode
# at 32 and 128 sequences, 32 adapters) and on most grid shapes (benchmarks/README.md).
FUSED_MAX_TOKENS = int(os.environ.get("LORAFLEET_FUSED_MAX_TOKENS", "0"))
MAX_SPLIT = 16  # K splits of the shrink; the expand adds the partial sums fully unrolled
PLAN_PROGRAMS_PER_SM = 2  # programs per SM the work is cut for (the launch uses the occupancy)


@dataclass(frozen=True)
class FusedPlan:
    """One launch's shape, derived from (T, R, H, slice sizes) on the host."""

    fuse_slices: bool
    block_k: int
    k_per_split: int
    split: int
    block_n: int
    chunk_tiles: int
    """NB: BLOCK_N column tiles per expand item."""
    chunk_starts: tuple[int, int]
    """First chunk index of slices 1 and 2 (= the chunk count where a slice is absent)."""
    chunks: int


@functools.lru_cache(maxsize=256)
def plan(tokens: int, bm: int, rank: int, hidden: int, sizes: tuple[int, ...], elem: int,
         device: torch.device, tuning: FusedTuning) -> FusedPlan:  # fmt: skip
    """Launch shape: fuse slices while their accumulators fit (rank <= 64), split K until
    the shrink has about `shrink_items_per_program` items per program, and cut columns
    into chunks for about `expand_items_per_program` expand items per program. Tile
    counts are estimated from T alone (ceil(T / BLOCK_M), the fewest possible), so
    more adapters than expected means more items per program, never idle SMs."""
    br = block_r(rank)
    programs = num_sms(device) * PLAN_PROGRAMS_PER_SM if device.type == "cuda" else 1
    fuse = tuning.fuse_slices and len(sizes) * br <= 64
    rows = bm + (len(sizes) if fuse else 1) * br
    bk = tuning.block_k or (256 if bm <= 16 else 128)
    while not tuning.block_k and bk > 32 and rows * bk * elem * tuning.num_stages > 160_000:
        bk //= 2
    bk = min(bk, max(16, next_pow2(hidden)))
    tiles = cdiv(tokens, bm)
    groups = 1 if fuse else len(sizes)
    steps = cdiv(hidden, bk)
    want = cdiv(int(tuning.shrink_items_per_program * programs), tiles * groups)
    k_per_split = cdiv(steps, min(max(1, want), steps, MAX_SPLIT)) * bk
    bn = tuning.block_n if br <= 64 else min(tuning.block_n, 64)
    col_tiles = [cdiv(n, bn) for n in sizes]
    per_tile = max(1, int(tuning.expand_items_per_program * programs) // tiles)
    nb = max(1, min(8, sum(col_tiles) // per_tile))
    chunks = [cdiv(ct, nb) for ct in col_tiles]
    starts = [sum(chunks[:i]) for i in range(1, 3)]
    total = sum(chunks)
    ch1, ch2 = (st if i + 1 < len(sizes) else total for i, st in enumerate(starts))
    return FusedPlan(
        fuse_slices=fuse, block_k=bk, k_per_split=k_per_split, split=cdiv(hidden, k_per_split),
        block_n=bn, chunk_tiles=nb, chunk_starts=(ch1, ch2), chunks=total,
    )  # fmt: skip


def resident_programs(n_regs: int, shared: int, num_warps: int, max_shared: int) -> int:
    """Programs of a compiled kernel that fit on one SM at once (registers, shared memory,
    threads), with a margin. The fused kernel's programs wait
    on each other, so its grid must never exceed what is resident (else it deadlocks).

    Registers go to warps in units of 256 (65536 per SM); each program also reserves 1 KB
    of shared memory. The margin (8 registers, 4 KB) covers another specialization of the
    same kernel (Triton recompiles for alignments) using a few more."""
    regs_per_warp = -(-(n_regs + 8) * 32 // 256) * 256
    by_regs = (65536 // regs_per_warp) // num_warps
    by_shared = (max_shared + 1024) // (shared + 1024 + 4096)
    by_threads = 2048 // (32 * num_warps)
    return max(1, min(by_regs, by_shared, by_threads))


_RESIDENT: dict[tuple, int] = {}


def _programs(
    device: torch.device, tuning: FusedTuning, launch_args: tuple, launch_kwargs: dict
) -> int:
    """Grid size: SMs x min(resident programs of this specialization, the tuning's cap);
    1 under the interpreter, which runs programs one after another (one program then does
    every item in order)."""
    if device.type != "cuda":
        return 1
    x, y = launch_args[0], launch_args[3]
    key = (device, x.dtype, y.dtype, *sorted(launch_kwargs.items()))
    got = _RESIDENT.get(key)
    if got is None:
        compiled = _fused_kernel.warmup(*launch_args, grid=(1,), **launch_kwargs)
        compiled._init_handles()
        props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
        per_sm = resident_programs(
            compiled.n_regs, compiled.metadata.shared, launch_kwargs["num_warps"],
            props["max_shared_mem"],
        )  # fmt: skip
        got = _RESIDENT[key] = per_sm
    return num_sms(device) * min(got, tuning.max_programs_per_sm)


def lora_shrink_expand_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: tuple[torch.Tensor, ...],
    lora_b: tuple[torch.Tensor, ...],
    token_slots_or_meta: torch.Tensor | SegmentMeta,
    *,
    scale: float = 1.0,
    add_inputs: bool = True,
) -> torch.Tensor:
    """y: [T, sum N_s] (in place, any strides); x: [T, H]; lora_a: S x [L, R, H]; lora_b:
    S x [L, N_s, R]; token_slots_or_meta: int [T] slot map or a SegmentMeta for (T, L)."""
    sa = check_x_a(x, lora_a)
    sb = check_y_b(y, lora_b)
    num_slots, rank, hidden = sa.shapes[0]
    tokens = x.shape[0]
    if sb.count != sa.count or sb.shapes[0][0] != num_slots or sb.shapes[0][2] != rank:
        raise ValueError(
            f"lora_b: {sb.count} slices of {sb.shapes[0][0]} slots, rank {sb.shapes[0][2]}; "
            f"allowed: lora_a's {sa.count} slices, {num_slots} slots, rank {rank}"
        )
    if sb.base.dtype != x.dtype or y.shape[0] != tokens or y.device != x.device:
        raise ValueError(
            f"lora_b {sb.base.dtype}, y [{y.shape[0]}, ..] on {y.device}; allowed: x's dtype "
            f"{x.dtype}, {tokens} rows on {x.device}"
        )
    if tokens == 0:
        return y
    meta = as_meta(token_slots_or_meta, tokens, num_slots, x.device, rank)
    sizes = tuple(sh[1] for sh in sb.shapes)
    tuning = TUNING_OVERRIDE or TUNING["decode" if meta.block_m <= 16 else "prefill"]
    p = plan(tokens, meta.block_m, rank, hidden, sizes, x.element_size(), x.device, tuning)
    br = block_r(rank)
    part = torch.empty(
        p.split * len(sizes) * meta.max_tiles * meta.block_m * br,
        dtype=torch.float32, device=x.device,
    )  # fmt: skip
    ns = sizes + (0,) * (3 - len(sizes))
    stride_l, stride_bn, stride_br = (sb.per_slice(d) for d in range(3))
    kwargs = dict(
        SPLIT=p.split, NS=len(sizes), NSL=len(sizes) if p.fuse_slices else 1,
        BLOCK_M=meta.block_m, BLOCK_R=br, BLOCK_K=p.block_k, BLOCK_N=p.block_n,
        EVEN_K=hidden % p.k_per_split == 0, ADD_INPUTS=bool(add_inputs),
        PRECISION=dot_precision(x.dtype),
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )  # fmt: skip

    def args(programs: int) -> tuple:
        return (
            x, sa.base, sb.base, y, part,
            meta.tile_slot, meta.tile_rank, meta.tile_tok, meta.num_tiles, meta.sync,
            meta.max_tiles, programs,
            sa.offsets[0], sa.offsets[1], sb.offsets[0], sb.offsets[1],
            x.stride(0), x.stride(1), sa.strides[0][0], sa.strides[0][1], sa.strides[0][2],
            *stride_l, *stride_bn, *stride_br, y.stride(0), y.stride(1),
            ns[0], ns[1], ns[2], p.chunk_starts[0], p.chunk_starts[1], p.chunks,
            hidden, rank, p.k_per_split, float(scale), p.chunk_tiles,
        )  # fmt: skip

    programs = _programs(x.device, tuning, args(num_sms(x.device)), kwargs)
    _fused_kernel[(programs,)](*args(programs), **kwargs)
    return y
