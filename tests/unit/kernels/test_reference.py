"""The torch reference against the dense float64 oracle (ranks, slot -1, slices)."""

import pytest
import torch

from kernels import SegmentMeta, build_meta, lora_expand, lora_shrink
from kernels.reference import lora_expand_ref, lora_shrink_ref
from kernels.testing import oracle_expand, oracle_shrink, random_slices, random_slots, rel_err


@pytest.mark.parametrize("path", ["bmm", "grouped"])
@pytest.mark.parametrize("sizes", [(24,), (16, 8), (32, 8, 8)])
@pytest.mark.parametrize("ranked", [False, True])
def test_reference_matches_oracle(sizes, ranked, path, monkeypatch):
    """Both formulations of the reference (per-token bmm for small problems, grouped by
    slot for large ones) against the oracle, with slot -1 rows left untouched."""
    import kernels.reference

    monkeypatch.setattr(kernels.reference, "_BMM_MAX_ELEMENTS", 1 << 30 if path == "bmm" else 0)
    tokens, hidden, slots, rank = 13, 40, 5, 8
    x = torch.randn(tokens, hidden)
    token_slots = random_slots(tokens, slots, 3, 0.3)
    ranks = torch.tensor([1, 8, 3, 5, 2], dtype=torch.int32) if ranked else None
    lora_a = random_slices(slots, [(rank, hidden)] * len(sizes), torch.float32, "cpu", 1.0)
    lora_b = random_slices(slots, [(n, rank) for n in sizes], torch.float32, "cpu", 1.0)
    buf = lora_shrink_ref(x, lora_a, token_slots, scale=0.5, slot_ranks=ranks)
    assert rel_err(buf, oracle_shrink(x, lora_a, token_slots, 0.5, ranks)) < 1e-6
    y = torch.randn(tokens, sum(sizes))
    y[token_slots < 0] = float("nan")  # never read or written
    want = oracle_expand(y, buf, lora_b, token_slots, True, ranks)
    lora_expand_ref(y, buf, lora_b, token_slots, slot_ranks=ranks)
    has = token_slots >= 0
    assert rel_err(y[has], want[has]) < 1e-6 and torch.isnan(y[~has]).all()
    fresh = torch.randn(tokens, sum(sizes))
    keep = fresh.clone()
    lora_expand_ref(fresh, buf, lora_b, token_slots, add_inputs=False, slot_ranks=ranks)
    assert torch.equal(fresh[~has], keep[~has])
    assert (
        rel_err(
            fresh[has],
            oracle_expand(torch.zeros_like(keep), buf, lora_b, token_slots, True, ranks)[has],
        )
        < 1e-6
    )


def test_default_backend_on_cpu_is_reference_and_takes_meta(monkeypatch):
    monkeypatch.delenv("LORAFLEET_KERNELS", raising=False)
    x = torch.randn(4, 16)
    token_slots = torch.tensor([1, -1, 0, 1])
    lora_a = random_slices(2, [(4, 16)], torch.float32, "cpu", 1.0)
    meta = build_meta(token_slots, 2, slot_ranks=torch.tensor([4, 2]))
    assert isinstance(meta, SegmentMeta)
    out = lora_shrink(x, lora_a, meta)
    assert rel_err(out, oracle_shrink(x, lora_a, token_slots, 1.0, meta.slot_ranks)) < 1e-6
    assert out[0, 1].abs().sum() == 0 and out[0, [0, 3], 2:].abs().sum() == 0
    y = torch.randn(4, 8)
    before = y.clone()
    lora_expand(y, out, random_slices(2, [(8, 4)], torch.float32, "cpu", 1.0), meta)
    assert torch.equal(y[1], before[1])


def test_unknown_backend_raises(monkeypatch):
    monkeypatch.setenv("LORAFLEET_KERNELS", "cuda")
    with pytest.raises(ValueError, match="LORAFLEET_KERNELS"):
        lora_shrink(torch.randn(1, 4), (torch.randn(1, 2, 4),), torch.tensor([0]))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_shrink_into_a_caller_zeroed_buffer(backend, monkeypatch):
    """The engine's per-step workspace path: writing into `out` equals allocating."""
    monkeypatch.setenv("LORAFLEET_KERNELS", backend)
    x = torch.randn(6, 32)
    token_slots = torch.tensor([1, -1, 0, 1, 2, -1])
    lora_a = random_slices(3, [(16, 32)] * 3, torch.float32, "cpu", 1.0)
    meta = build_meta(token_slots, 3, slot_ranks=torch.tensor([16, 4, 9]))
    want = lora_shrink(x, lora_a, meta)
    out = torch.zeros(3, 6, 16)
    got = lora_shrink(x, lora_a, meta, out=out)
    assert got.data_ptr() == out.data_ptr() and rel_err(got, want) < 1e-6
    assert rel_err(want, oracle_shrink(x, lora_a, token_slots, 1.0, meta.slot_ranks)) < 1e-6
    with pytest.raises(ValueError, match="out"):
        lora_shrink(x, lora_a, meta, out=torch.zeros(3, 6, 8))
    with pytest.raises(ValueError, match="out"):
        lora_shrink(x, lora_a, meta, out=torch.zeros(3, 6, 16, dtype=torch.float16))


@pytest.mark.parametrize("backend", ["bmm", "grouped", "triton"])
def test_out_of_range_slots_count_as_no_adapter_on_every_backend(backend, monkeypatch):
    """Slots outside [-1, L) are the caller's bug; the Triton metadata treats them as -1
    (never reading out of bounds). The reference raised an IndexError for slot >= L and
    read slot -2 as -1: now both backends give the slot -1 result, bit for bit."""
    import kernels.reference

    if backend == "triton":
        monkeypatch.setenv("LORAFLEET_KERNELS", "triton")
    else:
        big = 1 << 30 if backend == "bmm" else 0
        monkeypatch.setattr(kernels.reference, "_BMM_MAX_ELEMENTS", big)
    x = torch.randn(5, 32)
    lora_a = random_slices(3, [(8, 32)] * 2, torch.float32, "cpu", 1.0)
    lora_b = random_slices(3, [(16, 8), (8, 8)], torch.float32, "cpu", 1.0)
    bad = torch.tensor([2, -2, 0, 3, 7])
    clean = torch.tensor([2, -1, 0, -1, -1])
    y0 = torch.randn(5, 24)
    want_buf = lora_shrink(x, lora_a, clean)
    want_y = lora_expand(y0.clone(), want_buf, lora_b, clean)
    got_buf = lora_shrink(x, lora_a, bad)
    assert torch.equal(got_buf, want_buf)
    assert torch.equal(lora_expand(y0.clone(), want_buf, lora_b, bad), want_y)
    assert torch.equal(want_y[[1, 3, 4]], y0[[1, 3, 4]])
