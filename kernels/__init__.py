"""Pure tensor functions for segmented (Punica SGMV) LoRA: shrink and expand.

`kernels` knows nothing about adapters or requests: only slots and tensors.

Semantics:
    lora_shrink(x, lora_a, token_slots, scale=1.0) -> out: float32 [S, T, R]
        for t, s: out[s, t] = scale * A_s[slot_t] @ x[t]   (0 where slot_t == -1)
    lora_expand(y, buf, lora_b, token_slots, add_inputs=True) -> y
        for t with slot_t >= 0, for s: y[t, off_s:off_s+N_s] (+)= B_s[slot_t] @ buf[s, t]

Backend: LORAFLEET_KERNELS=auto|triton|reference (auto: Triton on CUDA tensors,
reference on CPU).
"""

from __future__ import annotations

import os

import torch

from kernels.reference import lora_expand_ref, lora_shrink_ref

_BACKENDS = ("auto", "triton", "reference")


def backend_for(device: torch.device) -> str:
    """Which implementation runs for tensors on `device` ("triton" or "reference")."""
    choice = os.environ.get("LORAFLEET_KERNELS", "auto")
    if choice not in _BACKENDS:
        raise ValueError(f"LORAFLEET_KERNELS={choice!r}; allowed: {', '.join(_BACKENDS)}")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "reference"
    return choice


def lora_shrink(x, lora_a, token_slots, *, scale: float = 1.0):
    """x: [T, H]; lora_a: tuple of S [L, R, H]; token_slots: int [T] -> float32 [S, T, R]."""
    if backend_for(x.device) == "triton":
        from kernels.triton.lora_shrink import lora_shrink_triton

        return lora_shrink_triton(x, lora_a, token_slots, scale=scale)
    return lora_shrink_ref(x, lora_a, token_slots, scale=scale)


def lora_expand(y, buf, lora_b, token_slots, *, add_inputs: bool = True):
    """y: [T, sum N_s] updated in place; buf: float32 [S, T, R]; lora_b: tuple of S [L, N_s, R]."""
    if backend_for(y.device) == "triton":
        from kernels.triton.lora_expand import lora_expand_triton

        return lora_expand_triton(y, buf, lora_b, token_slots, add_inputs=add_inputs)
    return lora_expand_ref(y, buf, lora_b, token_slots, add_inputs=add_inputs)


__all__ = ["backend_for", "lora_expand", "lora_shrink"]
