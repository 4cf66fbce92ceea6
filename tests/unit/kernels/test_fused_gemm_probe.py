"""The fused-GEMM probe's kernel (benchmarks/fused_gemm_probe.py) against float64, in the
Triton interpreter: its H200 figures are only worth reading if its LoRA term is right."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import fused_gemm_probe as probe  # noqa: E402

TOKENS, HIDDEN, RANK, SLOTS = 9, 64, 16, 6


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("widths,bn", [((64,), 32), ((64, 64), 64), ((64, 32, 32), 32)])
def test_fused_gemm_matches_float64(widths, bn):
    x = torch.randn(TOKENS, HIDDEN)
    w = torch.randn(sum(widths), HIDDEN) * HIDDEN**-0.5
    # B slices rank-major, as the engine's slots and lora_bench.Pool store them
    b = tuple(torch.randn(SLOTS, RANK, n).transpose(1, 2) for n in widths)
    slots = torch.randint(0, SLOTS, (TOKENS,))
    act = torch.unique(slots).to(torch.int32)
    h = torch.randn(len(widths), TOKENS, RANK)
    y = torch.full((TOKENS, sum(widths)), float("nan"))
    probe.gemm_lora(x, w, y, (16, bn, 32, 1, 4), (h, b, slots.to(torch.int32), act))
    want = probe.reference(x, w, h, b, slots)
    assert _rel(y, want) < 1e-5
    # the LoRA term is there and slice-specific: the slices' h swapped give another y
    if len(widths) > 1:
        probe.gemm_lora(x, w, y, (16, bn, 32, 1, 4), (h.flip(0), b, slots.to(torch.int32), act))
        assert _rel(y, want) > 1e-2


def test_plain_gemm_and_refusals():
    x, w = torch.randn(TOKENS, HIDDEN), torch.randn(96, HIDDEN)
    y = torch.full((TOKENS, 96), float("nan"))
    probe.gemm_lora(x, w, y, (16, 32, 32, 1, 4))
    assert _rel(y, x.double() @ w.double().t()) < 1e-5
    with pytest.raises(ValueError, match="do not tile"):
        probe.gemm_lora(x, w, y, (16, 64, 32, 1, 4))
