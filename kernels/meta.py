"""Per-step segment metadata for the segmented LoRA kernels, built on the device.

The model runner builds one `SegmentMeta` per step (or refills a preallocated one
with `build_meta(..., out=meta)`) and passes it to every LoRA layer in place of
`token_slots`. Building it uses only device work with shapes fixed by (T, L): no
host synchronisation, so a decode step that builds it can be captured in a CUDA graph.

Worked example: token_slots = [2, -1, 0, 2, 2], num_slots L = 3, block_m = 2.
    key         = [2, 3, 0, 2, 2]        slot, with -1 (and out-of-range) -> L
    tokens/slot = [1, 0, 3]              slot 0: token 2; slot 2: tokens 0, 3, 4
    tiles/slot  = [1, 0, 2]              ceil(tokens / block_m)
    max_tiles   = ceil(5 / 2) + min(3, 5) = 6
    tile_slot   = [0, 2, 2, -1, -1, -1]  slot of each block_m-row tile; -1 = no work
    tile_rank   = [R, R, R, 0, 0, 0]     rank of the tile's slot (R = slot_ranks[slot])
    tile_tok    = [[2, -1], [0, 3], [4, -1], [-1, -1], [-1, -1], [-1, -1]]
                                         token of each row, in token order; -1 = padding
    num_tiles   = [3]                    tiles with work (they come first)
A kernel program reads one tile's slot, rank and tokens with independent loads (no
chain of dependent index loads), so tokens of slot -1 cost nothing and no work is
done for absent slots.

`sync` ([max_tiles + 1] int32, zero between launches) is the fused kernel's scratch:
per-tile counts of finished shrink work, then a count of finished programs; the last
program to finish zeroes it again. Every build zeroes it (so `SegmentMeta.empty` need
not: its contents are undefined until built).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.backend import backend_for

# Rank recorded for a slot when the caller gives no ranks: "use the pool's max rank".
FULL_RANK = 2**30


def default_block_m(
    num_tokens: int, max_rank: int | None = None, expected_slots: int | None = None
) -> int:
    """Rows per tile: small tiles for decode-sized batches, larger ones for prefill.

    max_rank: the pool's rank (slot width), if known. Pools of rank <= 16 keep 32-row
    tiles above 1024 tokens: on the H200 (results/lora_kernels_tune_h200.json, run 11),
    shrink+expand at T=4096 took 52.1 vs 56.6 us (qkv r16), 154.6 vs 173.5 (gate_up
    r16), 37.0 vs 38.2 (o r16) with 32 against 64 rows; rank 64 wants 64 (75.7 vs 95.4
    us, qkv r64). Tiles of 16 rows were slower at T=4096 for every layer, and so were
    tiles of 128 rows at T = 1024-4096 for every layer and rank (run 17: qkv r64 T=4096
    n=8 90.1 vs 73.0 us; the expand reads B half as often but loses more to occupancy).

    expected_slots: the step's distinct slots (SegmentMeta.expected_slots), if known.
    Between 257 and 1024 tokens, pools of rank > 16 take 64-row tiles when the step has
    at least PREFILL_TOKENS_PER_SLOT tokens per expected slot, else 32. Run 18 (the whole
    grid with 64 rows there): faster with few adapters (gate_up r64 T=1024 n=1 53.6 vs
    64.3 us, qkv r64 T=1024 n=1 22.5 vs 30.4) but 1.12-1.31x slower at n = 64, where a
    slot's 16 tokens fill a quarter of a 64-row tile.
    """
    if num_tokens <= 256:
        return 16
    small_rank = max_rank is not None and max_rank <= 16
    if num_tokens <= 1024:
        few = expected_slots is not None and num_tokens >= PREFILL_TOKENS_PER_SLOT * expected_slots
        return 64 if few and not small_rank else 32
    return 32 if small_rank else 64


PREFILL_TOKENS_PER_SLOT = 64
"""default_block_m: tokens per expected slot from which a 257-1024-token step of a rank > 16
pool takes 64-row tiles (a full tile per slot on average)."""


def max_tiles(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Upper bound of sum_l ceil(seg_len_l / block_m): each active slot adds one partial tile."""
    return -(-num_tokens // block_m) + min(num_slots, num_tokens)


def grid_follows_expected_slots(block_m: int) -> bool:
    """Whether the Triton kernels size their tile grids by SegmentMeta.expected_slots for
    tiles of block_m rows: decode tiles (16 rows), at any rank.
    Prefill tiles keep the grid for all L slots (measurements: kernels.triton.common.
    expected_slots), so a caller need not vary expected_slots there."""
    return block_m <= 16


MAX_TILE_PROGRAMS = 65535
"""The tile programs are a CUDA grid's y / z dimension (at most 65535): about 1M tokens at
block_m 16, 4M at 64."""

MAX_TILE_COPIES = 4
"""Tiles one program of the separate kernels may cover (tile_copies): the grid has at
least max_tiles / MAX_TILE_COPIES tile programs. Tune run 22 on the H200 (shrink +
expand with expected_slots = n on the 72 decode shapes of lora_tune.tune_hint, caps 2 /
4 / 8): a cap of 4 took 0.996x the time of 8 in geometric mean (0.92-1.05x: o r16 T=64
n=8 5.2 vs 5.4 us, qkv r64 T=64 n=1 6.8 vs 7.5; gate_up r16 T=64 n=8 10.2 vs 9.8), a
cap of 2 1.012x (up to 1.20x at rank 16 with one adapter)."""


def expected_tiles(
    num_tokens: int, num_slots: int, block_m: int, expected_slots: int | None = None
) -> int:
    """Tiles a step can have with `expected_slots` distinct slots (None: any number up to
    L): ceil(T / block_m) + min(slots, T), each slot adding one partial tile."""
    slots = num_slots if expected_slots is None else min(num_slots, max(1, expected_slots))
    return max_tiles(num_tokens, slots, block_m)


def tile_programs(
    num_tokens: int, num_slots: int, block_m: int, expected_slots: int | None = None
) -> int:
    """Programs the separate shrink/expand kernels launch along tiles; program p computes
    tiles p, p + programs, ... (tile_copies of them). One per possible tile while that
    bound is small; with many slots and many tokens the bound is loose (most slots
    absent), so cap it and let each program cover a few.

    expected_slots: distinct slots the step is expected to hold (SegmentMeta.expected_slots):
    one program per tile those could make, ceil(T / block_m) + expected_slots, instead of
    one per tile all L slots could. Every program past the device-side tile count still
    costs a launch slot on an SM (H200, tune run 20: qkv r16 T=64 with 1 adapter, shrink +
    expand 8.3 us with 68 tile programs, 5.1 with 4); a step with more slots than expected
    is still computed whole, its extra tiles in the programs' further copies.
    """
    bound = max_tiles(num_tokens, num_slots, block_m)
    programs = min(expected_tiles(num_tokens, num_slots, block_m, expected_slots),
                   -(-num_tokens // block_m) + 64)  # fmt: skip
    programs = max(programs, -(-bound // MAX_TILE_COPIES))
    if programs > MAX_TILE_PROGRAMS:
        raise ValueError(
            f"token_slots: {num_tokens} tokens need {programs} tile programs of {block_m} rows; "
            f"allowed: at most {MAX_TILE_PROGRAMS} (a CUDA grid dimension): split the step"
        )
    return programs


def tile_copies(num_tokens: int, num_slots: int, block_m: int, programs: int) -> int:
    """Tiles each of `programs` tile programs covers so that together they cover every
    tile the step can have (max_tiles): a power of two (a compile-time constant of the
    kernels, so few variants), at most MAX_TILE_COPIES for tile_programs' grids. The
    kernels compute the first straight and the others as guarded copies, not a loop:
    Triton 3.9's sm_90 build of a kernel with the loop took up to twice the registers even
    where it never ran (rank-64 decode shrink 71 -> 139, gate_up expand tile 131 -> 208;
    with 2 copies 72, 133; with 8: 72, 172)."""
    need = -(-max_tiles(num_tokens, num_slots, block_m) // programs)
    return 1 << max(0, need - 1).bit_length()


@dataclass(frozen=True)
class SegmentMeta:
    """Tokens grouped by slot into tiles, ready for the kernels (module docstring's example).

    All tensors live on the device of `token_slots`; int32 unless stated.
    """

    token_slots: torch.Tensor
    """int64 [T]: the slot map this was built from (the torch reference reads it)."""
    slot_ranks: torch.Tensor
    """[L]: actual rank of each slot (FULL_RANK = the pool's max rank)."""
    tile_slot: torch.Tensor
    """[max_tiles]: slot of each tile, -1 for a tile with no work."""
    tile_rank: torch.Tensor
    """[max_tiles]: slot_ranks[tile_slot] (0 for a tile with no work)."""
    tile_tok: torch.Tensor
    """[max_tiles, block_m]: token index of each row of each tile, -1 for padding rows."""
    num_tiles: torch.Tensor
    """[1]: tiles with work; they come first in the tile list."""
    sync: torch.Tensor
    """[max_tiles + 1]: the fused kernel's flags and program counter; zero between launches."""
    num_slots: int
    """L: slots in the adapter pool."""
    block_m: int
    """Rows per tile; the kernels' BLOCK_M."""
    expected_slots: int | None = None
    """Distinct slots the caller expects in the step (None: any number up to L). The
    Triton kernels size their grids for that many (tile_programs) at decode tiles
    (kernels.triton.common.grid_expected: where the H200 measured it faster); more are
    still computed, in each program's further tile copies (tile_copies). An engine knows
    it on the host when it forms the batch (and keys its CUDA graphs by a bucket of it)."""

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    @property
    def max_tiles(self) -> int:
        return self.tile_slot.shape[0]

    @property
    def device(self) -> torch.device:
        return self.token_slots.device

    @classmethod
    def empty(
        cls,
        num_tokens: int,
        num_slots: int,
        device: torch.device,
        block_m: int | None = None,
        max_rank: int | None = None,
        expected_slots: int | None = None,
    ) -> SegmentMeta:
        """Preallocated buffers for `build_meta(..., out=meta)` (contents undefined until
        built); block_m None: default_block_m(num_tokens, max_rank, expected_slots);
        expected_slots as the field."""
        if num_tokens < 1 or num_slots < 1:
            raise ValueError(f"num_tokens={num_tokens}, num_slots={num_slots}; both must be >= 1")
        bm = default_block_m(num_tokens, max_rank, expected_slots) if block_m is None else block_m
        if bm < 1 or bm & (bm - 1):
            raise ValueError(
                f"block_m={bm}; allowed: a power of two (>= 16 for the Triton kernels)"
            )
        if expected_slots is not None and not 1 <= expected_slots <= num_slots:
            raise ValueError(
                f"expected_slots={expected_slots}; allowed: None or 1..num_slots={num_slots}"
            )
        nt = max_tiles(num_tokens, num_slots, bm)

        def buf(*shape: int) -> torch.Tensor:
            return torch.empty(shape, dtype=torch.int32, device=device)

        return cls(
            token_slots=torch.empty(num_tokens, dtype=torch.int64, device=device),
            slot_ranks=buf(num_slots),
            tile_slot=buf(nt),
            tile_rank=buf(nt),
            tile_tok=buf(nt, bm),
            num_tiles=buf(1),
            sync=buf(nt + 1),
            num_slots=num_slots,
            block_m=bm,
            expected_slots=expected_slots,
        )


def _check_inputs(token_slots: torch.Tensor, slot_ranks: torch.Tensor | None, num_slots: int):
    if token_slots.dim() != 1 or token_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"token_slots: got {token_slots.dtype} of shape {tuple(token_slots.shape)}; "
            "allowed: 1-D int32 or int64 [T]"
        )
    if slot_ranks is not None and (
        slot_ranks.shape != (num_slots,) or slot_ranks.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"slot_ranks: got {slot_ranks.dtype} of shape {tuple(slot_ranks.shape)}; "
            f"allowed: int32 or int64 [{num_slots}] (one rank per slot)"
        )


def build_meta(
    token_slots: torch.Tensor,
    num_slots: int,
    slot_ranks: torch.Tensor | None = None,
    out: SegmentMeta | None = None,
    max_rank: int | None = None,
    expected_slots: int | None = None,
) -> SegmentMeta:
    """token_slots: int [T] in [-1, L); slot_ranks: int [L] or None -> SegmentMeta.

    max_rank: the rank of the pool the kernels will read (picks the tile height when
    `out` is None: default_block_m). expected_slots: SegmentMeta.expected_slots, when
    `out` is None (a preallocated `out` carries its own).

    Device work only into fixed-shape buffers: no host sync, CUDA-graph capturable when
    `out` is preallocated. On the Triton backend it is one kernel (a radix sort in one
    program, kernels/triton/build_meta.py); otherwise a few torch ops. Slots outside [-1, L) are the caller's
    bug; they are treated as -1 so the kernels never read out of bounds.
    """
    _check_inputs(token_slots, slot_ranks, num_slots)
    tokens = token_slots.shape[0]
    dev = token_slots.device
    if out is None:
        out = SegmentMeta.empty(
            tokens, num_slots, dev, max_rank=max_rank, expected_slots=expected_slots
        )
    elif out.num_tokens != tokens or out.num_slots != num_slots or out.device != dev:
        raise ValueError(
            f"out: built for T={out.num_tokens}, L={out.num_slots} on {out.device}; "
            f"allowed: T={tokens}, L={num_slots} on {dev}"
        )
    if slot_ranks is not None and slot_ranks.device != dev:
        raise ValueError(f"slot_ranks is on {slot_ranks.device}; allowed: {dev}")
    if backend_for(dev) == "triton":
        from kernels.triton.build_meta import build_meta_triton

        build_meta_triton(token_slots, slot_ranks, out)
    else:
        _build_torch(token_slots, slot_ranks, out)
    return out


def _build_torch(token_slots: torch.Tensor, slot_ranks: torch.Tensor | None, out: SegmentMeta):
    """The same metadata from torch ops (CPU, and the reference the Triton build is tested on)."""
    bm, num_slots, nt = out.block_m, out.num_slots, out.max_tiles
    dev = token_slots.device
    out.token_slots.copy_(token_slots)
    slots = out.token_slots
    key = torch.where((slots < 0) | (slots >= num_slots), num_slots, slots)
    order = torch.sort(key, stable=True).indices
    skey = key[order]
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    seg_len = counts[:num_slots]
    seg_start = torch.cumsum(seg_len, 0) - seg_len
    tiles = (seg_len + bm - 1) // bm
    tile_end = torch.cumsum(tiles, 0)
    tile_begin = tile_end - tiles
    # Sorted position p holds the q-th token of its slot: row q % bm of that slot's tile q // bm.
    sk = skey.clamp(max=num_slots - 1)
    q = torch.arange(order.shape[0], device=dev) - seg_start[sk]
    dest = torch.where(skey < num_slots, (tile_begin[sk] + q // bm) * bm + q % bm, nt * bm)
    flat = torch.full((nt * bm + 1,), -1, dtype=torch.int32, device=dev)
    flat.scatter_(0, dest, order.to(torch.int32))
    out.tile_tok.view(-1).copy_(flat[: nt * bm])
    if slot_ranks is None:
        out.slot_ranks.fill_(FULL_RANK)
    else:
        out.slot_ranks.copy_(slot_ranks)
    i = torch.arange(nt, device=dev, dtype=torch.int64)
    slot = torch.searchsorted(tile_end, i, right=True)
    valid = slot < num_slots
    slot_c = slot.clamp(max=num_slots - 1)
    out.tile_slot.copy_(torch.where(valid, slot, -1))
    out.tile_rank.copy_(torch.where(valid, out.slot_ranks[slot_c], 0))
    out.num_tiles.copy_(tile_end[-1:])
    out.sync.zero_()
