"""The stacked-layout probe's expand (benchmarks/stacked_expand.py) against float64, in the
Triton interpreter: its GPU figures are only worth reading if it adds the right LoRA term,
read out of the stacked GEMM's columns of each row's own slot and slice."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kernels.triton.common import as_meta

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

from stacked_expand import stacked_expand  # noqa: E402

TOKENS, SLOTS, RANK = 11, 5, 8


@pytest.mark.parametrize("sizes", [(32,), (24, 8, 8), (16, 16)])
def test_stacked_expand_matches_float64(sizes):
    slots = torch.randint(-1, SLOTS, (TOKENS,))
    # B slices rank-major, as the engine's slots store them
    b = tuple(torch.randn(SLOTS, RANK, n).transpose(1, 2) for n in sizes)
    n_base = sum(sizes)
    out = torch.randn(TOKENS, n_base + len(sizes) * SLOTS * RANK)
    h = out[:, n_base:].view(TOKENS, len(sizes), SLOTS, RANK).double()
    want = out[:, :n_base].double().clone()
    col = 0
    for s, n in enumerate(sizes):
        for t in range(TOKENS):
            if slots[t] >= 0:
                want[t, col : col + n] += b[s][slots[t]].double() @ h[t, s, slots[t]]
        col += n
    stacked_expand(out, n_base, b, as_meta(slots, TOKENS, SLOTS, out.device, RANK))
    got = out[:, :n_base].double()
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    assert torch.equal(out[slots < 0, :n_base].double(), want[slots < 0])  # untouched rows
