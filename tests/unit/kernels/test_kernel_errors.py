"""Bad arguments raise ValueError naming the argument: the Triton launchers, and the
public calls on the torch reference backend (the CPU default), which ran whatever it
was given (a y one column too wide was left half-updated, 4 slices were computed)."""

import pytest
import torch

import kernels
from kernels import SegmentMeta, build_meta
from kernels.triton.lora_expand import lora_expand_triton
from kernels.triton.lora_shrink import lora_shrink_triton

CPU = torch.device("cpu")


def _shrink_args():
    return (
        torch.randn(4, 32),
        (torch.randn(2, 8, 32), torch.randn(2, 8, 32)),
        torch.tensor([0, 1, -1, 0]),
    )


SHRINK_CASES = [
    (lambda x, a, s: (x.half(), a, s), "lora_a"),
    (lambda x, a, s: (x, a[0], s), "lora_a"),
    (lambda x, a, s: (x, a * 2, s), "lora_a"),
    (lambda x, a, s: (x, (a[0], a[1][:, :4]), s), "lora_a"),
    (lambda x, a, s: (x[:, :16], a, s), "H="),
    (lambda x, a, s: (x[0], a, s), "x"),
    (lambda x, a, s: (x.long(), tuple(t.long() for t in a), s), "x|lora_a"),
    (lambda x, a, s: (x, a, s[:3]), "token_slots"),
    (lambda x, a, s: (x, a, s.float()), "token_slots"),
    (lambda x, a, s: (x, a, s.tolist()), "token_slots"),
    (lambda x, a, s: (x, a, build_meta(s, 3)), "token_slots"),
]
TRITON_ONLY_SHRINK_CASES = [
    (lambda x, a, s: (x, (torch.randn(2, 300, 32),), s), "rank"),
    (
        lambda x, a, s: (x, a, build_meta(s, 2, out=SegmentMeta.empty(4, 2, CPU, block_m=8))),
        "block_m",
    ),
]


@pytest.mark.parametrize("change,match", SHRINK_CASES + TRITON_ONLY_SHRINK_CASES)
def test_shrink_refuses(change, match):
    x, a, s = change(*_shrink_args())
    with pytest.raises(ValueError, match=match):
        lora_shrink_triton(x, a, s)


EXPAND_CASES = [
    (lambda y, buf, b, s: (y[:, :10], buf, b, s), "y"),
    (lambda y, buf, b, s: (torch.randn(4, 25), buf, b, s), "y"),
    (lambda y, buf, b, s: (y.int(), buf, b, s), "y"),
    (lambda y, buf, b, s: (y, buf[:1], b, s), "buf"),
    (lambda y, buf, b, s: (y, buf, (b[0], b[1].half()), s), "lora_b"),
    (lambda y, buf, b, s: (y, buf, (b[0], torch.randn(2, 8, 4)), s), "lora_b"),
    (lambda y, buf, b, s: (y, buf, b, torch.tensor([0, 1])), "token_slots"),
    (lambda y, buf, b, s: (y[:3], buf, b, s), "buf"),
    (lambda y, buf, b, s: (y, buf, b * 2, s), "lora_b"),
]


def _expand_args():
    return (
        torch.randn(4, 24),
        torch.randn(2, 4, 8),
        (torch.randn(2, 16, 8), torch.randn(2, 8, 8)),
        torch.tensor([0, 1, -1, 0]),
    )


@pytest.mark.parametrize("change,match", EXPAND_CASES)
def test_expand_refuses(change, match):
    y, buf, b, s = change(*_expand_args())
    with pytest.raises(ValueError, match=match):
        lora_expand_triton(y, buf, b, s)


@pytest.mark.parametrize("change,match", SHRINK_CASES)
def test_reference_shrink_refuses(monkeypatch, change, match):
    monkeypatch.setenv("LORAFLEET_KERNELS", "reference")
    x, a, s = change(*_shrink_args())
    with pytest.raises(ValueError, match=match):
        kernels.lora_shrink(x, a, s)


@pytest.mark.parametrize("change,match", EXPAND_CASES)
def test_reference_expand_refuses(monkeypatch, change, match):
    monkeypatch.setenv("LORAFLEET_KERNELS", "reference")
    y, buf, b, s = change(*_expand_args())
    before = y.clone() if isinstance(y, torch.Tensor) else None
    with pytest.raises(ValueError, match=match):
        kernels.lora_expand(y, buf, b, s)
    assert before is None or torch.equal(y, before)  # refused before writing anything


def test_cpu_without_interpreter_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        lora_shrink_triton(*_shrink_args())


def test_slice_checks_are_cached_per_tensors_and_revalidated_for_new_ones():
    from kernels.triton.common import slices_of

    a = (torch.randn(2, 8, 32), torch.randn(2, 8, 32))
    first = slices_of(a, "lora_a")
    assert slices_of(a, "lora_a") is first  # same tensors: checked once
    assert slices_of(list(a), "lora_a") is first
    bad = (a[0], torch.randn(3, 8, 32))
    with pytest.raises(ValueError, match="slots"):
        slices_of(bad, "lora_a")
    other = (torch.randn(2, 8, 32),)
    assert slices_of(other, "lora_a") is not first and slices_of(other, "lora_a").count == 1


def test_per_slice_strides_pad_with_slice_zero():
    """Absent slices repeat slice 0's stride: a unit stride shared by every slice stays
    a constant 1 through the kernel's pick by slice (Triton then vectorises the loads;
    padding with 0 made the rank-major B loads scalar on the H200, 3-7x slower)."""
    from kernels.testing import rank_major
    from kernels.triton.common import slices_of

    gate_up = rank_major((torch.randn(2, 48, 8), torch.randn(2, 48, 8)))
    sl = slices_of(gate_up, "lora_b")
    assert sl.per_slice(1) == (1, 1, 1)
    assert sl.per_slice(2) == (48, 48, 48)
    qkv = rank_major((torch.randn(2, 64, 8), torch.randn(2, 16, 8), torch.randn(2, 16, 8)))
    assert slices_of(qkv, "lora_b").per_slice(2) == (64, 16, 16)
    assert slices_of(qkv, "lora_b").per_slice(0) == (512, 128, 128)


def test_pdl_off_on_the_cpu_and_by_env(monkeypatch):
    from kernels.triton.common import launch_pdl, pdl_enabled

    assert not pdl_enabled(CPU)
    assert launch_pdl(False) == {} and launch_pdl(True) == {"launch_pdl": True}
    monkeypatch.setenv("LORAFLEET_PDL", "0")
    assert not pdl_enabled(torch.device("cuda"))  # decided before any CUDA query
