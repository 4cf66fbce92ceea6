"""Torch reference for the segmented LoRA shrink/expand contract (see kernels/__init__.py).

Correct on any device and dtype; used on CPU by default and as the oracle for the
Triton kernels. Tokens are grouped by slot so the cost is one gather+matmul per
active slot, never per token.
"""

from __future__ import annotations

import torch


def _groups(token_slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """[(slot, token_indices)] for every slot >= 0 present in token_slots."""
    slots = token_slots.tolist()
    by_slot: dict[int, list[int]] = {}
    for t, s in enumerate(slots):
        if s >= 0:
            by_slot.setdefault(s, []).append(t)
    dev = token_slots.device
    return [(s, torch.tensor(idx, device=dev, dtype=torch.long)) for s, idx in by_slot.items()]


def lora_shrink_ref(
    x: torch.Tensor,
    lora_a: tuple[torch.Tensor, ...],
    token_slots: torch.Tensor,
    *,
    scale: float = 1.0,
) -> torch.Tensor:
    """x: [T, H]; lora_a: S x [L, R, H]; token_slots: int [T] -> float32 [S, T, R]."""
    num_slices = len(lora_a)
    tokens = x.shape[0]
    rank = lora_a[0].shape[1]
    out = torch.zeros(num_slices, tokens, rank, dtype=torch.float32, device=x.device)
    for slot, idx in _groups(token_slots):
        xs = x.index_select(0, idx).float()
        for s, a in enumerate(lora_a):
            out[s, idx] = scale * (xs @ a[slot].float().t())
    return out


def lora_expand_ref(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: tuple[torch.Tensor, ...],
    token_slots: torch.Tensor,
    *,
    add_inputs: bool = True,
) -> torch.Tensor:
    """y: [T, sum N_s] (in place); buf: float32 [S, T, R]; lora_b: S x [L, N_s, R]."""
    for slot, idx in _groups(token_slots):
        offset = 0
        for s, b in enumerate(lora_b):
            n = b.shape[1]
            delta = buf[s, idx].float() @ b[slot].float().t()
            cur = y[idx, offset : offset + n]
            new = cur.float() + delta if add_inputs else delta
            y[idx, offset : offset + n] = new.to(y.dtype)
            offset += n
    return y
