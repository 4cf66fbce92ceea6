"""Which implementation runs: LORAFLEET_KERNELS=auto|triton|reference."""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "reference")


def backend_for(device: torch.device) -> str:
    """Which implementation runs for tensors on `device` ("triton" or "reference").

    auto: Triton on CUDA tensors, the torch reference on CPU. `triton` on CPU tensors
    needs TRITON_INTERPRET=1 set before kernels.triton is imported (the CPU tests).
    """
    choice = _env_choice("LORAFLEET_KERNELS", BACKENDS)
    if choice == "auto":
        return "triton" if device.type == "cuda" else "reference"
    return choice


MOE_PREP = ("auto", "triton", "torch")


def moe_prep() -> str:
    """Where kernels.fused_moe's alignment and k-choice sum run, on the Triton backend
    ("triton" or "torch"), by LORAFLEET_MOE_PREP=auto|triton|torch.

    triton (auto): kernels/triton/moe_align.py and moe_sum.py (three launches, no zero
    fill); on an H100 a Mixtral-8x7B layer at T = 1 took 257 us under graph replay
    against 319 with the torch pair (results/moe_gpu_prep_h100.json).
    torch: kernels.moe_align.align_moe_ref (a dozen launches), a zero fill and torch.sum:
    kept to compare against.
    """
    choice = _env_choice("LORAFLEET_MOE_PREP", MOE_PREP)
    return "triton" if choice == "auto" else choice


def check_env() -> None:
    """Reads LORAFLEET_KERNELS and LORAFLEET_MOE_PREP now: ValueError naming the bad value
    when a model is built (replica.engine_setup), not on its first forward pass."""
    _env_choice("LORAFLEET_KERNELS", BACKENDS)
    moe_prep()


def _env_choice(var: str, allowed: tuple[str, ...]) -> str:
    """The environment's value of var ("auto" when unset), refused unless in allowed."""
    choice = os.environ.get(var, "auto")
    if choice not in allowed:
        raise ValueError(f"{var}={choice!r}; allowed: {', '.join(allowed)}")
    return choice
