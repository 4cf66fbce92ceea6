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
    choice = os.environ.get("LORAFLEET_KERNELS", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"LORAFLEET_KERNELS={choice!r}; allowed: {', '.join(BACKENDS)}")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "reference"
    return choice
