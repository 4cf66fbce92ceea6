"""Launch planning for the segmented shrink (kernels/triton/lora_shrink.py, split-K, and
lora_shrink_stream.py, stream-K): the launch config, its defaults per tile shape from
the H200 tune runs, and how K is split over programs. Plain Python, no kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.triton.common import cdiv, next_pow2, num_sms

MAX_K_PER_SPLIT = 1024  # longer serial K loops per program left down_proj (H=14336) at half speed
MIN_K_STEPS = 2  # k-steps per program at least, where ShrinkConfig.split_for_expected


@dataclass(frozen=True)
class ShrinkConfig:
    """Launch shape (benchmarks may set lora_shrink.CONFIG_OVERRIDE to sweep it)."""

    block_k: int
    """H columns per step; a power of two >= 16."""
    programs_per_sm: int
    """Split K until about this many programs per SM exist."""
    fuse_slices: bool
    """One program computes all slices (x tile read once) instead of one each."""
    num_stages: int = 3
    num_warps: int = 4
    stream_k: bool = False
    """Persistent stream-K launch (lora_shrink_stream.py): programs_per_sm programs per
    SM in all, each walking an equal run of (tile, k-step) items in one pipelined loop,
    instead of one program per (tile bound, k-split)."""
    stack_slices: bool = True
    """With fuse_slices and S > 1: the slices' A rows of the tile's slot are one stacked
    operand (tiles.stacked_rows), so each k-step is ONE dot of the x tile with
    next_pow2(S x BLOCK_R) rows instead of S dots of BLOCK_R rows each. H200
    (results/shrink_probe_h200.json, --ab): qkv r16 T=4096 n=1 in 32-row tiles 17.2 vs
    20.8 us; tune run 14 at n = 8-32: within +-5% either way."""
    stack_tail: bool = False
    """With stack_slices and S x BLOCK_R not a power of two (qkv: 3 x 64 = 192 rows): stack
    the first S - 1 slices (a power of two of rows) and give the last its own dot per
    k-step, instead of padding the stacked operand to the next power of two (256 rows,
    a quarter of them padding)."""
    max_k_per_split: int = MAX_K_PER_SPLIT
    """K columns one program's serial loop may cover (the split-K grid: more splits when
    one program's share would be longer). A --tune knob (benchmarks/lora_tune.py
    _long_k_configs); the defaults keep MAX_K_PER_SPLIT."""
    split_for_expected: bool = False
    """Size the K splits for the tiles the step is expected to have
    (kernels.meta.expected_tiles with SegmentMeta.expected_slots) instead of for the grid
    of all L slots: about programs_per_sm programs with work per SM at rank 16, scaled by
    16 / BLOCK_R (a rank-64 program streams 4x the bytes of A), the splits a power of
    two, each program at least MIN_K_STEPS k-steps (decode: split_k). Not the tile
    programs launched: those include the empty ones that the tile-copy cap adds (tune
    run 23: down r64 T=64 n=1, 17 programs for 5 tiles, shrink 6.5 us with the 16 splits
    they gave, 5.2 with the 56 that 5 tiles give)."""
    k_splits: int = 0
    """K splits of the split-K grid, fixed (a --tune knob: benchmarks/lora_tune.py
    _decode_shrink_configs); 0: from programs_per_sm and max_k_per_split."""
    lean_x: bool = True
    """Read x tiles without a row mask (rows past a tile's tokens read x's row 0; their
    sums land only in rows the store masks) with 32-bit offsets, where every x offset
    fits in int32: about half the address instructions per x element. Tune run 13 on
    the H200: shrinks 0-5% faster (qkv r64 T=4096 n=8 37.7 vs 39.9 us), none slower
    beyond 0.1 us; the kernel grid moved by under 1% (geometric means)."""


DECODE_PROGRAMS_PER_SM = 16
"""Decode shrinks (ShrinkConfig.split_for_expected): programs with work per SM at rank 16.
Tune run 22 on the H200 (results/lora_kernels_tune_h200.json, 18 decode shapes, the
shrink alone by its K splits): the best split puts about 1,500-2,000 such programs on
the 132 SMs at rank 16 (qkv r16 T=64: 16 splits with 1 adapter, 8 with 64) and about
400-500 at rank 64. The H200 grid with this rule against the tenth sitting's (shrink +
expand, geometric means): decode rank 16 0.977x (qkv r16 T=64 n=64 22.6 -> 19.8 us,
down r16 T=64 n=32 12.2 -> 11.1), rank 64 1.003x (0.93-1.14x), mixed 0.981x; prefill
(unchanged code) 1.002-1.006x. Tried in the same session and reverted: 16 splits at
every rank and K, halved where more than 24 programs with work per SM would result
(tune run 22's most common best split), 1.014x / 1.018x of the tenth sitting's grid at
rank 16 / 64: one-token steps lost most (down r64 T=1 n=1 5.2 -> 7.5 us with 16 splits
of 7 k-steps; logs/lora_kernels_h200_run_4500222_split16.json)."""

STREAM_SHARED_BYTES = 220_000
"""Shared memory a stream-K launch plans for per SM: its programs must all be resident
(a second wave of persistent programs is a tail)."""


def default_config(
    bm: int,
    br: int,
    elem: int,
    num_slices: int = 3,
    hidden: int = 4096,
    tokens: int | None = None,
    expected: int | None = None,
) -> ShrinkConfig:
    """Decode (bm 16): per-slice programs of 2 warps, K split for the step's expected tiles
    (ShrinkConfig.split_for_expected, DECODE_PROGRAMS_PER_SM); steps of many adapters
    with 1-2 tokens each stack all slices in one program (_stacks_decode). Tune run 22
    against the previous rule (K split until ~32 programs per SM at rank 16, ~16 above,
    over the grid for all L slots, 4 warps): qkv r16 T=64 n=64 16.9 -> 13.8 us, n=32
    9.5 -> 8.9, n=1 3.9 -> 3.5; down r16 T=64 n=64 16.4 -> 14.8 (2 warps: 0.85-1.0x of 4
    at 8 or more splits, 1.1-1.4x at 4). Prefill at rank <= 32: fused slices
    (the S accumulators fit in registers), ~4 per SM; BLOCK_K 128, halved until 3
    pipeline stages of the x and A tiles fit in ~120 KB of shared memory. Prefill at rank
    >= 64: stream-K (stream_config), except long K (H > 8192) in 32-row tiles, which
    takes the fused split-K grid as at rank <= 32, and rank-64 gate_up and qkv in 64-row
    tiles of steps over 1024 tokens, and qkv in 32-row tiles of 1024-token steps whose
    expected slots fill them (_stacks_rank64; tokens: the step's T, None for a step over
    1024; expected: its expected slots), which take it with their A rows stacked.

    From `benchmarks/lora_kernels.py --tune` on the H200 (results/lora_kernels_tune_h200.json):
    over 4 prefill shapes within 1% of the best. Runs 8 and 10: the best stream-K config
    per shape 0.97-1.14x the best split-K one at decode, 0.96-1.09x at rank-16 prefill
    (not used there).
    """
    prefill = bm >= 32
    if not prefill and _stacks_decode(num_slices, tokens, expected):  # BLOCK_K 128 as tuned
        warps = 2 if br <= 16 else 4
        return ShrinkConfig(128, DECODE_PROGRAMS_PER_SM, True, num_warps=warps,
                            split_for_expected=True, stack_tail=True)  # fmt: skip
    stacked = _stacks_rank64(bm, br, num_slices, tokens, expected)
    if prefill and br >= 64 and (bm >= 64 or hidden <= 8192) and not stacked:
        return stream_config(bm, br, elem, hidden)
    fuse = prefill and br <= 64
    rows = bm + (_stacked_rows(num_slices, br, stacked) if fuse else br)
    bk = 128
    while bk > 32 and rows * bk * elem * 3 > 120_000:
        bk //= 2
    if not prefill:
        return ShrinkConfig(bk, DECODE_PROGRAMS_PER_SM, False, num_warps=2, split_for_expected=True)
    return ShrinkConfig(bk, 4, fuse, stack_tail=stacked)


def stream_config(bm: int, br: int, elem: int, hidden: int) -> ShrinkConfig:
    """Stream-K for prefill at rank >= 64: per-slice programs (fused slices were 1.2-1.6x
    slower: the fat programs that fit one per SM starve the pipeline), 5 stages (3 x / A
    buffers: two items in flight), BLOCK_K 128 and 2 programs per SM, or 64 and 3 per
    SM for long K (H > 8192), fewer where their shared memory does not fit.

    Tune run 8 on the H200 against the split-K grid's best: qkv r64 T=4096 n=8 39.1 vs
    46.0 us, gate_up r64 T=4096 n=8 33.8 vs 36.3, down r64 T=4096 n=32 69.5 vs 81.1,
    qkv r64 T=1024 n=32 28.4 vs 30.3. Not used for long K in 32-row tiles (T <= 1024):
    the grid of 2026-12-03 measured down r64 T=1024 n=1 and n=8 8-13% slower with it.
    """
    bk, per_sm = (64, 3) if hidden > 8192 else (128, 2)
    while bk > 16 and 3 * (bm + br) * bk * elem > STREAM_SHARED_BYTES:
        bk //= 2
    fit = STREAM_SHARED_BYTES // (3 * (bm + br) * bk * elem)
    return ShrinkConfig(bk, max(1, min(per_sm, fit)), False, num_stages=5, stream_k=True)


def _stacks_decode(num_slices: int, tokens: int | None, expected: int | None) -> bool:
    """Decode tiles of a multi-slice layer (qkv, gate_up) in a step of at least
    STACK_DECODE_MIN_SLOTS expected slots with at most 2 tokens each: one program for all
    slices, their A rows stacked (qkv: q and k one operand, v a second dot), so each x
    tile and tile's metadata is read once instead of once per slice, with the K split
    for the expected tiles (3x the splits of per-slice programs for qkv); BLOCK_K 128,
    2 warps at rank 16 and 4 above. H200, 2026-12-04 (fifteenth sitting, tune run 27,
    results/lora_kernels_tune_h200.json), shrink + expand against per-slice programs in
    the same session: qkv r16 T=64 n=64 18.5 vs 19.8 us, n=32 11.2 vs 11.6; gate_up r16
    T=64 n=64 36.8 vs 39.0; qkv r64 T=64 n=64 48.9 vs 50.7, n=32 28.5 vs 28.9. It lost
    with fewer adapters or more tokens per adapter (qkv r64 T=1 n=1 6.4 vs 5.1, T=256
    n=8 17.4 vs 16.6; qkv r16 T=256 n=32 12.4 vs 12.1) and was even at T=256 n=64."""
    if num_slices < 2 or tokens is None or expected is None:
        return False
    return expected >= STACK_DECODE_MIN_SLOTS and tokens <= 2 * expected


STACK_DECODE_MIN_SLOTS = 32
"""_stacks_decode: the fewest expected slots (tune run 27 measured 32 and 64)."""


def _stacks_rank64(
    bm: int, br: int, num_slices: int, tokens: int | None = None, expected: int | None = None
) -> bool:
    """Rank-64 slices in 64-row prefill tiles of steps over 1024 tokens (tokens None: such a
    step): the fused split-K grid with the slices' A rows stacked (gate_up: one 128-row
    operand; qkv: 128 rows for q and k and one more dot for v, ShrinkConfig.stack_tail)
    instead of stream-K. H200, 2026-12-04, the shrink alone against stream-K in the same
    session: gate_up r64 T=4096 n=8 26.9 vs 30.8 us, n=32 33.3 vs 41.2, n=1 24.7 vs 24.8
    (results/shrink_stack_h200.json); qkv r64 T=4096 n=1 24.1 vs 29.1, n=8 34.6 vs 39.3,
    n=64 57.8 vs 62.1, T=2048 n=32 30.4 vs 35.0 (results/shrink_tail_h200.json; one
    256-row operand for qkv's 192 rows had lost, 43.1 vs 34.4 at n=8). Steps of at most
    1024 tokens keep stream-K in 64-row tiles (few adapters, kernels.meta.default_block_m):
    their 16-17 tiles leave the split-K grid short of programs (qkv r64 T=1024 n=1 15.7
    vs 12.7 us with stream-K), and splitting K finer for them was slower still (18.7).

    Also qkv (the tail stack) in 32-row tiles of 1024-token steps with at least 32 tokens
    per expected slot (`expected`: SegmentMeta.expected_slots), so every slot fills a
    tile: H200 grid, 2026-12-04 (fourteenth sitting, logs/lora_kernels_h200_stack32.json),
    the shrink alone against stream-K in the same session: qkv r64 T=1024 n=32 26.3 vs
    28.7 us, the 16/64 mix 20.9 vs 25.0; with 16 tokens per slot it lost (n=64 47.0 vs
    43.0), and so did gate_up's pair (n=32 24.0 vs 23.6; n=64 33.5 vs 35.2).
    """
    if br != 64 or num_slices not in (2, 3):
        return False
    if bm == 32:
        full = expected is not None and tokens is not None and tokens >= 32 * expected
        return num_slices == 3 and full and tokens >= STACK_32_MIN_TOKENS
    return bm >= 64 and (tokens is None or tokens > 1024)


STACK_32_MIN_TOKENS = 1024
"""_stacks_rank64 in 32-row tiles: measured at 1024-token steps only (32-row rank-64 tiles
exist between 257 and 1024 tokens)."""


def _tail_fits(nsl: int, br: int) -> bool:
    """nsl x br rows would pad to a power of two, and nsl - 1 slices stack without padding."""
    rows, head = nsl * br, (nsl - 1) * br
    return nsl > 2 and rows != next_pow2(rows) and head == next_pow2(head)


def _stacked_rows(num_slices: int, br: int, tail: bool = False) -> int:
    """Rows of A one fused-slices program reads per k-step: the stacked operand's
    (ShrinkConfig.stack_slices: a power of two), or with a tail slice S x br."""
    return num_slices * br if tail and _tail_fits(num_slices, br) else next_pow2(num_slices * br)


def stack_tail_for(cfg: ShrinkConfig, nsl: int, br: int) -> bool:
    """The kernel's TAIL: cfg.stack_tail where the slices' rows would pad their operand."""
    return cfg.stack_tail and cfg.stack_slices and _tail_fits(nsl, br)


def block_s_for(cfg: ShrinkConfig, nsl: int, br: int) -> int:
    """The kernel's BLOCK_S: the stacked operand's rows (with a tail slice, those of the
    other slices), or 0 (one dot per slice). nsl > 1 only where cfg.fuse_slices (one
    program, all slices)."""
    if not cfg.stack_slices or nsl <= 1:
        return 0
    return (nsl - 1) * br if stack_tail_for(cfg, nsl, br) else next_pow2(nsl * br)


def offsets_fit_i32(x: torch.Tensor) -> bool:
    """Every element offset into x (2-D, non-negative strides) fits in int32."""
    return sum((n - 1) * st for n, st in zip(x.shape, x.stride(), strict=True)) < 2**31


def lean_x_for(cfg: ShrinkConfig, x_fits_i32: bool) -> bool:
    """The kernels' LEAN_X: cfg.lean_x where every x offset fits in int32
    (`offsets_fit_i32`; a host bool, so the memoised plans take it)."""
    return cfg.lean_x and x_fits_i32


def block_k_for(cfg: ShrinkConfig, hidden: int) -> int:
    """cfg.block_k, cut to H's next power of two (at least 16, tl.dot's minimum)."""
    return min(cfg.block_k, max(16, next_pow2(hidden)))


def split_k(cfg: ShrinkConfig, groups: int, tiles: int, hidden: int, br: int,
           device: torch.device):  # fmt: skip
    """(BLOCK_K, k_per_split, split) for `tiles` tiles of `groups` slice groups
    (ShrinkConfig.split_for_expected: the tiles the step is expected to have)."""
    bk = block_k_for(cfg, hidden)
    steps = cdiv(hidden, bk)
    work = cfg.programs_per_sm * num_sms(device)
    if cfg.k_splits:
        split = min(cfg.k_splits, steps)
    else:
        if cfg.split_for_expected:
            want = max(1, work * 16 // br // max(1, tiles * groups))
            want = min(1 << (want.bit_length() - 1), max(1, steps // MIN_K_STEPS))
        else:
            want = max(1, work // max(1, tiles * groups))
        split = min(max(want, cdiv(hidden, cfg.max_k_per_split)), steps)
    k_per_split = cdiv(steps, split) * bk
    return bk, k_per_split, cdiv(hidden, k_per_split)
