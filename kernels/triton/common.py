"""Shared launcher helpers: argument checks, metadata, per-slice pointer offsets.

Slices (q, k, v / gate, up) are separate tensors. One launch covers all of them:
the kernel gets slice 0's tensor plus each other slice's element offset from it
(computed from data_ptr on the host, no sync) and picks its base by slice index.
"""

from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass

import torch

from kernels.checks import MAX_SLICES, check_meta, check_slices
from kernels.meta import SegmentMeta, build_meta, grid_follows_expected_slots

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_RANK = 128  # the range tested on the GPU (tests/gpu/test_kernels.py)


def check_device(t: torch.Tensor, name: str) -> None:
    """Triton on CPU tensors only runs under the interpreter (set before kernels import)."""
    if t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{name} is on the CPU: the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 "
            "set before kernels.triton is imported; or use LORAFLEET_KERNELS=reference"
        )


@dataclass(frozen=True)
class Slices:
    """What a launcher needs from a tuple of S slice tensors (derived and checked once)."""

    base: torch.Tensor
    """Slice 0; the kernel reaches the others through `offsets`."""
    shapes: tuple[tuple[int, int, int], ...]
    strides: tuple[tuple[int, int, int], ...]
    offsets: tuple[int, int]
    """Element offsets of slices 1 and 2 from slice 0 (0 when absent)."""

    @property
    def count(self) -> int:
        return len(self.shapes)

    def per_slice(self, dim: int) -> tuple[int, int, int]:
        """Stride along `dim` of each slice, padded to MAX_SLICES (`per_slice_strides`)."""
        return per_slice_strides(self.strides, dim)


def per_slice_strides(strides: tuple[tuple[int, int, int], ...], dim: int) -> tuple[int, ...]:
    """Stride along `dim` of each slice of `strides` (Slices.strides), padded to MAX_SLICES
    (slices may differ: a rank-major B [L, R, N_s] viewed as [L, N_s, R] has an r-stride
    of N_s). Host values only, so the launchers' memoised plans take it."""
    # padded with slice 0's: equal strides stay equal, so Triton's specialisation of a
    # stride of 1 (vectorised loads) survives the kernel's pick by slice
    pad = (strides[0][dim],) * (MAX_SLICES - len(strides))
    return tuple(st[dim] for st in strides) + pad


# Pool tuples are passed on every layer of every step: check them once. Keyed by the
# tensors' ids, confirmed through weak references (a freed tensor's id may be reused).
# In-place metadata changes (set_, resize_, as_strided_) of a slice are not detected.
_SLICES_CACHE: dict[tuple[int, ...], tuple[tuple, Slices]] = {}
_SLICES_CACHE_MAX = 4096


def slices_of(tensors, name: str) -> Slices:
    """tuple of 1..3 3-D tensors of one dtype (fp16/bf16/fp32), slot count and device -> Slices."""
    key = tuple(map(id, tensors)) if isinstance(tensors, tuple | list) else None
    hit = _SLICES_CACHE.get(key) if key is not None else None
    if hit is not None and all(w() is t for w, t in zip(hit[0], tensors, strict=True)):
        return hit[1]
    info = _derive(check_slices(tensors, name, DTYPES))
    if len(_SLICES_CACHE) >= _SLICES_CACHE_MAX:
        _SLICES_CACHE.clear()
    _SLICES_CACHE[key] = (tuple(weakref.ref(t) for t in tensors), info)
    return info


def _derive(tensors: tuple[torch.Tensor, ...]) -> Slices:
    """Slices of tensors that passed `check_slices`."""
    first = tensors[0]
    return Slices(
        base=first,
        shapes=tuple(tuple(t.shape) for t in tensors),
        strides=tuple(t.stride() for t in tensors),
        offsets=_offsets(tensors),
    )


def as_meta(
    token_slots_or_meta, tokens: int, num_slots: int, device: torch.device, rank: int
) -> SegmentMeta:
    """A SegmentMeta for this call: the caller's (checked), or built now from token_slots
    (tile height for a pool of this rank)."""
    if isinstance(token_slots_or_meta, SegmentMeta):
        meta = token_slots_or_meta
        check_meta(meta, tokens, num_slots, device)
        if meta.block_m < 16:
            raise ValueError(f"token_slots (SegmentMeta): block_m={meta.block_m}; allowed: >= 16")
        return meta
    if not isinstance(token_slots_or_meta, torch.Tensor):
        raise ValueError("token_slots: an int tensor [T] or a kernels.SegmentMeta")
    if token_slots_or_meta.shape != (tokens,) or token_slots_or_meta.device != device:
        raise ValueError(
            f"token_slots: shape {tuple(token_slots_or_meta.shape)} on {token_slots_or_meta.device}; "
            f"allowed: [{tokens}] on {device}"
        )
    return build_meta(token_slots_or_meta, num_slots, max_rank=rank)


def _offsets(tensors) -> tuple[int, int]:
    """Element offsets of slices 1 and 2 from slice 0 (0 for missing slices)."""
    base = tensors[0].data_ptr()
    size = tensors[0].element_size()
    offs = []
    for t in tensors[1:]:
        delta = t.data_ptr() - base
        if delta % size:
            raise ValueError("slices must be element-aligned with each other")
        offs.append(delta // size)
    offs += [0] * (MAX_SLICES - 1 - len(offs))
    return offs[0], offs[1]


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact "ieee" for fp32 operands (Triton's default is tf32,
    ~1e-3 relative error, enough to flip greedy tokens against an fp32 reference)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (triton.cdiv is a constexpr function: microseconds per host call)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def block_r(rank: int) -> int:
    """Rank tile: the next power of two >= rank, at least 16 (tl.dot's minimum)."""
    if not 1 <= rank <= MAX_RANK:
        raise ValueError(f"rank {rank}; allowed: 1..{MAX_RANK}")
    return max(16, next_pow2(rank))


def grid_expected(block_m: int, expected: int | None) -> int | None:
    """`expected` (a SegmentMeta's expected_slots) where the separate kernels size their
    tile grids by it for tiles of block_m rows, else None (a grid for all L slots): decode
    tiles (16 rows), at any rank (kernels.meta.grid_follows_expected_slots). Host values
    only, so the launchers' memoised plans take it.

    Tiles past a smaller grid are computed in each program's further copies
    (kernels.meta.tile_copies). The H200 grid of the tenth sitting with it at every shape
    (results/logs/lora_kernels_h200_run_183ec60_everywhere.json), shrink + expand with
    expected_slots = n against the full grid, geometric means: decode rank 16 0.892x
    (qkv r16 T=64 n=1 8.3 -> 5.3 us, T=256 n=32 14.4 -> 12.9), rank 64 0.975x (gate_up
    r64 T=64 n=1 12.7 -> 10.7; at most 1.06x, gate_up r16/64 T=64 n=32); prefill 0.999x
    (32-row tiles, rank 16), 1.027x (32-row, rank 64) and 1.074x (64-row, rank 64: gate_up
    r64 T=4096 n=1 174 -> 208 us, all of it in the expand). A prefill program already
    moves many bytes, so the empty programs cost little there; why the expand with a
    second tile copy runs slower was not found (Triton 3.9's sm_90 build of its 64-row
    rank-64 tile: 158 -> 168 registers, the same 3 programs per SM)."""
    return expected if grid_follows_expected_slots(block_m) else None


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (the interpreter: 4, to keep program counts small)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@functools.lru_cache(maxsize=8)
def _pdl_capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (9, 0)


# Programmatic dependent launch of the expand behind its shrink (kernels.lora_shrink_expand,
# lora_shrink.overlaps_expand): every step of at most PDL_MAX_TOKENS tokens (H200 grid: the
# expand's launch and its B / old-y loads hide behind the shrink, median 1.0 us per layer
# call), and steps of at most PDL_PREFILL_MAX_TOKENS whose expand is at most
# PDL_MAX_WIDTH_RATIO times as wide as the shrink's input and whose shrink is not stream-K
# in 32-row tiles. H200, fourteenth sitting (results/logs/lora_kernels_h200_pdl_start.json,
# shrink + expand with and without PDL in the same run): at T=1024 down 0.94-0.99x, qkv
# r16 0.96-0.99x, o r16 0.95-1.03x, qkv / o r64 in 64-row tiles 0.93-1.005x; slower with
# it: gate_up's wide expands (1.04-1.13x: their early programs crowd the shrink) and the
# rank-64 stream-K shrinks in 32-row tiles (qkv / o r64 T=1024 n=32-64 1.04-1.07x). Above
# 1024 tokens it moved rows by -3% to +2% (o r16 T=4096 1.00-1.02x): 0.989x in geometric
# mean over 75 prefill rows against 0.990x with the 1024-token cap, so the cap stays.
# Triggering the expand at the end of the shrink's programs instead of the start was
# slower than no PDL (1.014x). LORAFLEET_PDL_MAX_TOKENS overrides the prefill cap.
PDL_MAX_TOKENS = 256
PDL_PREFILL_MAX_TOKENS = int(os.environ.get("LORAFLEET_PDL_MAX_TOKENS", "1024"))
PDL_MAX_WIDTH_RATIO = 2


def pdl_enabled(device: torch.device) -> bool:
    """Programmatic dependent launch (a kernel starts while the one before it drains):
    CUDA devices of compute capability >= 9.0, unless LORAFLEET_PDL=0. Never under the
    interpreter, which has no grid dependency control."""
    if device.type != "cuda" or os.environ.get("LORAFLEET_PDL", "1") == "0":
        return False
    return _pdl_capable(device)


def launch_pdl(enabled: bool) -> dict[str, bool]:
    """Launch keyword arguments for a programmatic dependent launch (none when off, so
    the kernel's compile options, and its cache key, stay as without PDL)."""
    return {"launch_pdl": True} if enabled else {}
