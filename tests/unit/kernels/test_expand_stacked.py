"""kernels.lora_expand_stacked (the stacked layout's expand: each row's slot columns read
out of the stacked GEMM's output) against float64, on the reference backend and the
Triton kernel in the interpreter, float32 and float16; per-slot ranks honoured, slot -1
rows untouched, bad shapes refused."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.meta import build_meta

TOKENS, SLOTS, RANK = 11, 5, 8
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _case(sizes, dtype, ranks=None):
    slots = torch.randint(-1, SLOTS, (TOKENS,))
    b = tuple((torch.randn(SLOTS, RANK, n) * RANK**-0.5).to(dtype).transpose(1, 2) for n in sizes)
    n_base = sum(sizes)
    out = torch.randn(TOKENS, n_base + len(sizes) * SLOTS * RANK).to(dtype)
    h = out[:, n_base:].view(TOKENS, len(sizes), SLOTS, RANK).double()
    want = out[:, :n_base].double().clone()
    col = 0
    for s, n in enumerate(sizes):
        for t in range(TOKENS):
            slot = int(slots[t])
            if slot >= 0:
                r = RANK if ranks is None else int(ranks[slot])
                want[t, col : col + n] += b[s][slot, :, :r].double() @ h[t, s, slot, :r]
        col += n
    return out, n_base, b, slots, want


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sizes", [(32,), (24, 8, 8), (16, 16)])
def test_stacked_expand_matches_float64(backend, dtype, sizes, monkeypatch):
    monkeypatch.setenv("LORAFLEET_KERNELS", backend)
    out, n_base, b, slots, want = _case(sizes, dtype)
    y = kernels.lora_expand_stacked(out, n_base, b, slots)
    assert y.data_ptr() == out.data_ptr() and y.shape == (TOKENS, n_base)
    got = out[:, :n_base].double()
    assert float((got - want).abs().max() / want.abs().max()) < TOL[dtype]
    assert torch.equal(got[slots < 0], want[slots < 0])  # rows of slot -1 untouched


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_per_slot_ranks_are_honoured(backend, monkeypatch):
    monkeypatch.setenv("LORAFLEET_KERNELS", backend)
    ranks = torch.tensor([8, 2, 5, 1, 8], dtype=torch.int32)
    out, n_base, b, slots, want = _case((24, 8, 8), torch.float32, ranks)
    meta = build_meta(slots, SLOTS, slot_ranks=ranks, max_rank=RANK)
    kernels.lora_expand_stacked(out, n_base, b, meta)
    got = out[:, :n_base].double()
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def test_bad_shapes_are_refused(monkeypatch):
    monkeypatch.setenv("LORAFLEET_KERNELS", "reference")
    out, n_base, b, slots, _ = _case((32,), torch.float32)
    with pytest.raises(ValueError, match="out: "):
        kernels.lora_expand_stacked(out[:, :-1], n_base, b, slots)
    with pytest.raises(ValueError, match="out: "):
        kernels.lora_expand_stacked(out, n_base - 1, b, slots)
