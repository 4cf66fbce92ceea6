"""Random small kernel inputs shared by the interpreter tests of the Triton kernels."""

import torch

from kernels.testing import random_slices, random_slots

SLICES = {1: (24,), 2: (40, 24), 3: (48, 16, 16)}


def case(tokens, hidden, num_slices, rank, distinct, none_frac, dtype, slots=4):
    """(token_slots, x, lora_a, lora_b) on the CPU: `distinct` of `slots` slots over the
    tokens, a none_frac share of them slot -1; B's slices are SLICES[num_slices] wide."""
    token_slots = random_slots(tokens, slots, distinct, none_frac)
    x = torch.randn(tokens, hidden).to(dtype)
    lora_a = random_slices(slots, [(rank, hidden)] * num_slices, dtype, "cpu", hidden**-0.5)
    lora_b = random_slices(slots, [(n, rank) for n in SLICES[num_slices]], dtype, "cpu", 1.0)
    return token_slots, x, lora_a, lora_b
