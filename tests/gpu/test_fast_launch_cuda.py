"""kernels/triton/launch.py on CUDA: the kept binaries are reused, and what they compute
equals the float64 reference, for aligned and unaligned pointers (run with -m gpu)."""

import pytest
import torch
import triton

import kernels.triton.launch as launch
import kernels.triton.lora_expand as expand_mod
import kernels.triton.lora_shrink as shrink_mod
from kernels import build_meta, lora_shrink_expand
from kernels.reference import lora_expand_ref, lora_shrink_ref
from kernels.testing import TOLERANCE, captured, random_slices, random_slots, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BF16, F32 = torch.bfloat16, torch.float32
CASES = [  # H, slice sizes, T, rank, distinct, dtype
    (4096, (4096, 1024, 1024), 1, 16, 1, BF16),
    (4096, (4096, 1024, 1024), 64, 16, 32, BF16),
    (4096, (14336, 14336), 16, 64, 8, BF16),
    (14336, (4096,), 300, 8, 16, F32),
    (4096, (4096,), 1024, 16, 4, BF16),  # (rank-64 prefill shrinks are stream-K: own launcher)
]


def _inputs(hidden, sizes, tokens, rank, distinct, dtype, slots=32, shift=0):
    """x and y shifted by `shift` elements from an allocation's start (shift 1: pointers
    not 16-byte aligned)."""
    token_slots = random_slots(tokens, slots, distinct, 0.1).cuda()
    xs = torch.randn(tokens * hidden + shift, device="cuda").to(dtype)
    x = xs[shift:].view(tokens, hidden)
    ys = torch.randn(tokens * sum(sizes) + shift, device="cuda").to(dtype)
    y = ys[shift:].view(tokens, sum(sizes))
    lora_a = random_slices(slots, [(rank, hidden)] * len(sizes), dtype, "cuda", hidden**-0.5)
    lora_b = random_slices(slots, [(n, rank) for n in sizes], dtype, "cuda", rank**-0.5)
    return token_slots, x, y, lora_a, lora_b


def _want(x, y, lora_a, lora_b, token_slots):
    buf = lora_shrink_ref(x.double(), tuple(a.double() for a in lora_a), token_slots)
    return lora_expand_ref(y.double(), buf, tuple(b.double() for b in lora_b), token_slots)


def test_on_for_the_tested_triton():
    if triton.__version__.startswith(launch.TESTED_TRITON):
        assert launch.ENABLED and shrink_mod._SHRINK.usable and expand_mod._EXPAND.usable


@pytest.mark.parametrize("hidden,sizes,tokens,rank,distinct,dtype", CASES)
def test_kept_binaries_compute_what_the_reference_does(
    hidden, sizes, tokens, rank, distinct, dtype
):
    fast = (shrink_mod._SHRINK.fast_calls, expand_mod._EXPAND.fast_calls)
    for shift in (0, 0, 1, 1, 0):  # fresh inputs each call; unaligned x and y in between
        token_slots, x, y, lora_a, lora_b = _inputs(
            hidden, sizes, tokens, rank, distinct, dtype, shift=shift
        )
        want = _want(x, y, lora_a, lora_b, token_slots)
        lora_shrink_expand(y, x, lora_a, lora_b, build_meta(token_slots, 32, max_rank=rank))
        assert rel_err(y, want) < TOLERANCE[dtype], f"shift {shift}"
    if launch.ENABLED:  # the 2nd, 4th and 5th calls reuse what the 1st and 3rd kept
        assert shrink_mod._SHRINK.fast_calls - fast[0] >= 3
        assert expand_mod._EXPAND.fast_calls - fast[1] >= 3


def test_kept_binaries_in_a_captured_graph():
    """Launches through kept binaries are captured like any other; replays follow new x."""
    hidden, sizes, tokens, rank = 4096, (4096, 1024, 1024), 32, 16
    token_slots, x, y0, lora_a, lora_b = _inputs(hidden, sizes, tokens, rank, 8, BF16)
    meta = build_meta(token_slots, 32, max_rank=rank)
    y = y0.clone()
    lora_shrink_expand(y, x, lora_a, lora_b, meta)  # keeps the binaries
    before = shrink_mod._SHRINK.fast_calls

    def step():
        y.copy_(y0)
        lora_shrink_expand(y, x, lora_a, lora_b, meta)

    graph = captured(step)
    if launch.ENABLED:
        assert shrink_mod._SHRINK.fast_calls > before
    for _ in range(2):
        x.copy_(torch.randn_like(x, dtype=F32).to(BF16))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(y, _want(x, y0, lora_a, lora_b, token_slots)) < TOLERANCE[BF16]


def test_off_gives_the_same_results(monkeypatch):
    token_slots, x, y, lora_a, lora_b = _inputs(4096, (4096, 1024, 1024), 64, 16, 8, BF16)
    meta = build_meta(token_slots, 32, max_rank=16)
    outs = []
    for on in (True, False, True):
        monkeypatch.setattr(launch, "ENABLED", on)
        out = y.clone()
        lora_shrink_expand(out, x, lora_a, lora_b, meta)
        outs.append(out)
    want = _want(x, y, lora_a, lora_b, token_slots)
    for out in outs:
        assert rel_err(out, want) < TOLERANCE[BF16]
    assert rel_err(outs[0], outs[1]) < 1e-2 * TOLERANCE[BF16]
