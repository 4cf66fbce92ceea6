"""Shared launcher helpers: argument checks, metadata, per-slice pointer offsets.

Slices (q, k, v / gate, up) are separate tensors. One launch covers all of them:
the kernel gets slice 0's tensor plus each other slice's element offset from it
(computed from data_ptr on the host, no sync) and picks its base by slice index.
"""

from __future__ import annotations

import functools
import os

import torch

from kernels.meta import SegmentMeta, build_meta

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SLICES = 3
MAX_RANK = 256


def check_device(t: torch.Tensor, name: str) -> None:
    """Triton on CPU tensors only runs under the interpreter (set before kernels import)."""
    if t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{name} is on the CPU: the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 "
            "set before kernels.triton is imported; or use LORAFLEET_KERNELS=reference"
        )


def check_slices(tensors, name: str, device: torch.device, dtype: torch.dtype | None = None):
    """tuple of 1..3 3-D tensors on `device` of one dtype (= dtype when given)."""
    if not isinstance(tensors, tuple | list) or not 1 <= len(tensors) <= MAX_SLICES:
        raise ValueError(
            f"{name}: a tuple of 1 to {MAX_SLICES} tensors (slices); got {type(tensors).__name__}"
        )
    first = tensors[0]
    for s, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name}[{s}]: a 3-D tensor; got {getattr(t, 'shape', t)!r}")
        if t.device != device:
            raise ValueError(f"{name}[{s}] is on {t.device}; allowed: {device}")
        if t.dtype != (dtype or first.dtype) or t.dtype not in DTYPES:
            raise ValueError(
                f"{name}[{s}] is {t.dtype}; allowed: {dtype or first.dtype} (one of fp16/bf16/fp32)"
            )
        if t.shape[0] != first.shape[0]:
            raise ValueError(f"{name}[{s}]: {t.shape[0]} slots; slice 0 has {first.shape[0]}")
    return first


def as_meta(token_slots_or_meta, tokens: int, num_slots: int, device: torch.device) -> SegmentMeta:
    """A SegmentMeta for this call: the caller's (checked), or built now from token_slots."""
    if isinstance(token_slots_or_meta, SegmentMeta):
        meta = token_slots_or_meta
        if meta.num_tokens != tokens or meta.num_slots != num_slots or meta.device != device:
            raise ValueError(
                f"token_slots (SegmentMeta): built for T={meta.num_tokens}, L={meta.num_slots} on "
                f"{meta.device}; allowed: T={tokens}, L={num_slots} on {device}"
            )
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
    return build_meta(token_slots_or_meta, num_slots)


def slice_offsets(tensors) -> tuple[int, int]:
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


def block_r(rank: int) -> int:
    """Rank tile: the next power of two >= rank, at least 16 (tl.dot's minimum)."""
    if not 1 <= rank <= MAX_RANK:
        raise ValueError(f"rank {rank}; allowed: 1..{MAX_RANK}")
    return max(16, 1 << (rank - 1).bit_length())


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (the interpreter: 4, to keep program counts small)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
