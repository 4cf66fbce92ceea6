"""Per-step segment metadata for the segmented LoRA kernels, built on the device.

The model runner builds one `SegmentMeta` per step (or refills a preallocated one
with `build_meta(..., out=meta)`) and passes it to every LoRA layer's
`lora_shrink` / `lora_expand` in place of `token_slots`. Building it uses only
device ops with shapes fixed by (T, L): no host synchronisation, so a decode step
that builds it can be captured in a CUDA graph.

Worked example: token_slots = [2, -1, 0, 2, 2], num_slots L = 3, block_m = 2.
    key         = [2, 3, 0, 2, 2]        slot, with -1 (and out-of-range) -> L
    sorted_idx  = [2, 0, 3, 4, 1]        tokens grouped by slot, slot -1 last
    seg_len     = [1, 0, 3]              tokens per slot
    seg_start   = [0, 1, 1]              first position of each slot in sorted_idx
    tiles/slot  = [1, 0, 2]              ceil(seg_len / block_m)
    max_tiles   = ceil(5 / 2) + min(3, 5) = 6
    tile_slot   = [0, 2, 2, -1, -1, -1]  slot of each block_m-row tile; -1 = no work
    tile_start  = [0, 1, 3, 0, 0, 0]     first position in sorted_idx of each tile
    tile_rows   = [1, 2, 1, 0, 0, 0]     valid rows of each tile
    num_tiles   = [3]                    tiles with work (they come first)
Kernels run a grid of programs that stride over tiles [0, num_tiles) (read on the
device), so tokens of slot -1 cost nothing and no work is done for absent slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Rank recorded for a slot when the caller gives no ranks: "use the pool's max rank".
FULL_RANK = 2**30


def default_block_m(num_tokens: int) -> int:
    """Rows per tile: small tiles for decode-sized batches, larger ones for prefill."""
    if num_tokens <= 256:
        return 16
    if num_tokens <= 1024:
        return 32
    return 64


def max_tiles(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Upper bound of sum_l ceil(seg_len_l / block_m): each active slot adds one partial tile."""
    return -(-num_tokens // block_m) + min(num_slots, num_tokens)


def tile_programs(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Programs the kernels launch along tiles; each strides over the valid tiles.

    One per possible tile while that bound is small; with many slots and many tokens
    the bound is loose (most slots absent), so cap it and let programs loop instead.
    """
    return min(max_tiles(num_tokens, num_slots, block_m), -(-num_tokens // block_m) + 64)


@dataclass(frozen=True)
class SegmentMeta:
    """Tokens grouped by slot, ready for the kernels (see the module docstring's example).

    All tensors live on the device of `token_slots`; int32 unless stated.
    """

    token_slots: torch.Tensor
    """int [T]: the slot map this was built from (the torch reference reads it)."""
    sorted_idx: torch.Tensor
    """[T]: token indices sorted by slot, tokens of slot -1 last."""
    seg_start: torch.Tensor
    """[L]: first position of each slot's tokens in sorted_idx."""
    seg_len: torch.Tensor
    """[L]: number of tokens of each slot."""
    slot_ranks: torch.Tensor
    """[L]: actual rank of each slot (FULL_RANK = the pool's max rank)."""
    tile_slot: torch.Tensor
    """[max_tiles]: slot of each tile, -1 for a tile with no work."""
    tile_start: torch.Tensor
    """[max_tiles]: first position in sorted_idx of each tile."""
    tile_rows: torch.Tensor
    """[max_tiles]: valid rows of each tile (0..block_m)."""
    num_tiles: torch.Tensor
    """[1]: tiles with work; they come first in the tile list."""
    num_slots: int
    """L: slots in the adapter pool."""
    block_m: int
    """Rows per tile; the kernels' BLOCK_M."""

    @property
    def num_tokens(self) -> int:
        return self.sorted_idx.shape[0]

    @property
    def device(self) -> torch.device:
        return self.sorted_idx.device

    @classmethod
    def empty(
        cls, num_tokens: int, num_slots: int, device: torch.device, block_m: int | None = None
    ) -> SegmentMeta:
        """Preallocated buffers for `build_meta(..., out=meta)` (contents undefined until built)."""
        if num_tokens < 1 or num_slots < 1:
            raise ValueError(f"num_tokens={num_tokens}, num_slots={num_slots}; both must be >= 1")
        bm = default_block_m(num_tokens) if block_m is None else block_m
        if bm < 1 or bm & (bm - 1):
            raise ValueError(
                f"block_m={bm}; allowed: a power of two (>= 16 for the Triton kernels)"
            )
        nt = max_tiles(num_tokens, num_slots, bm)

        def buf(n: int) -> torch.Tensor:
            return torch.empty(n, dtype=torch.int32, device=device)

        return cls(
            token_slots=torch.empty(num_tokens, dtype=torch.int64, device=device),
            sorted_idx=buf(num_tokens),
            seg_start=buf(num_slots),
            seg_len=buf(num_slots),
            slot_ranks=buf(num_slots),
            tile_slot=buf(nt),
            tile_start=buf(nt),
            tile_rows=buf(nt),
            num_tiles=buf(1),
            num_slots=num_slots,
            block_m=bm,
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
) -> SegmentMeta:
    """token_slots: int [T] in [-1, L); slot_ranks: int [L] or None -> SegmentMeta.

    Device ops only (sort, scatter_add, cumsum, searchsorted) into fixed-shape
    buffers: no host sync, CUDA-graph capturable when `out` is preallocated.
    Slots outside [-1, L) are the caller's bug; they are treated as -1 so the
    kernels never read out of bounds.
    """
    _check_inputs(token_slots, slot_ranks, num_slots)
    tokens = token_slots.shape[0]
    dev = token_slots.device
    if out is None:
        out = SegmentMeta.empty(tokens, num_slots, dev)
    elif out.num_tokens != tokens or out.num_slots != num_slots or out.device != dev:
        raise ValueError(
            f"out: built for T={out.num_tokens}, L={out.num_slots} on {out.device}; "
            f"allowed: T={tokens}, L={num_slots} on {dev}"
        )
    out.token_slots.copy_(token_slots)
    slots = out.token_slots
    key = torch.where((slots < 0) | (slots >= num_slots), num_slots, slots)
    order = torch.sort(key, stable=True).indices
    out.sorted_idx.copy_(order)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    seg_len = counts[:num_slots]
    seg_end = torch.cumsum(seg_len, 0)
    out.seg_len.copy_(seg_len)
    out.seg_start.copy_(seg_end - seg_len)
    if slot_ranks is None:
        out.slot_ranks.fill_(FULL_RANK)
    else:
        out.slot_ranks.copy_(slot_ranks)
    _fill_tiles(out, seg_len, seg_end - seg_len)
    return out


def _fill_tiles(out: SegmentMeta, seg_len: torch.Tensor, seg_start: torch.Tensor) -> None:
    """Tile list: tile i belongs to the slot whose cumulative tile count first exceeds i."""
    bm, num_slots = out.block_m, out.num_slots
    tiles = (seg_len + bm - 1) // bm
    tile_end = torch.cumsum(tiles, 0)
    i = torch.arange(out.tile_slot.shape[0], device=seg_len.device, dtype=torch.int64)
    slot = torch.searchsorted(tile_end, i, right=True)
    valid = slot < num_slots
    slot_c = slot.clamp(max=num_slots - 1)
    m0 = (i - (tile_end[slot_c] - tiles[slot_c])) * bm
    rows = (seg_len[slot_c] - m0).clamp(0, bm) * valid
    out.tile_slot.copy_(torch.where(valid, slot, -1))
    out.tile_start.copy_(torch.where(valid, seg_start[slot_c] + m0, 0))
    out.tile_rows.copy_(rows)
    out.num_tiles.copy_(tile_end[-1:])
