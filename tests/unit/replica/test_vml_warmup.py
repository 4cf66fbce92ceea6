"""An engine's process calls each MKL VML function first on one element (one thread),
so the first multi-threaded call of a fresh process (a TP worker's first prefill rotary
cos / sin) never races in MKL's lazy kernel dispatch (`replica.vml_warmup`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from replica.sampling_params import SamplingParams
from replica.vml_warmup import VML_DTYPES, VML_OPS
from tests.unit.replica.engines import small_engine


class _VmlCalls(TorchDispatchMode):
    """Records (op, dtype, numel) of every VML op the dispatcher runs."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in VML_OPS and isinstance(out, torch.Tensor) and out.dtype in VML_DTYPES:
            self.calls.append((name, out.dtype, out.numel()))
        return out


def test_each_vml_function_runs_on_one_element_before_the_first_step(llama_dir):
    """A 200-token first step: its rotary cos / sin ([200, head_dim], split across the
    intra-op threads) come after a one-element call of each in the same dtype."""
    prompt = [5 + i % 300 for i in range(200)]
    with _VmlCalls() as mode:
        engine = small_engine(llama_dir, max_num_batched_tokens=256)
        engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
    warmed: set[tuple[str, torch.dtype]] = set()
    big = []
    for name, dtype, numel in mode.calls:
        if numel == 1:
            warmed.add((name, dtype))
        elif (name, dtype) not in warmed:
            big.append((name, dtype, numel))
    assert {name for name, _, n in mode.calls if n > 2048} >= {"cos", "sin"}  # the rotary's
    assert big == []


def test_the_warmed_ops_are_those_aten_sends_to_mkl():
    header = Path(torch.__file__).parent / "include" / "ATen" / "cpu" / "vml.h"
    if not header.exists():
        pytest.skip("this torch has no ATen headers")
    mkl_ops = set(re.findall(r"^IMPLEMENT_VML_MKL\((\w+),", header.read_text(), re.M))
    assert mkl_ops == set(VML_OPS)
