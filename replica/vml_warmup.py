"""Warm MKL's vector math (VML) up before a process runs its model.

ATen computes float unary ops of CPU tensors (cos, sin, exp, log, sqrt, tanh, ...) with
MKL's VML, each intra-op thread calling it on its chunk (ops of more than 2048 elements
are split across threads). oneMKL 2024.2, the MKL of the torch CPU wheels, picks each VML
function's kernel lazily on that function's first call in the process; when that first
call runs on several threads at once, one thread can run a low-accuracy kernel for its
whole chunk of that one call, although high accuracy is asked for (pytorch/pytorch#188792;
later calls are right, so a rerun is clean).

In the engine that first call is the first prefill's rotary cos / sin in layer 0. A
tensor-parallel worker is a fresh process: given a 369-token step as its first, about one
start in ten computed one thread's half of [T, head_dim] cos / sin with errors of ~2e-4, so
its rotated keys of those tokens were off and every later prompt logprob moved from HF's
by up to 6e-4. A one-element call runs on the calling thread alone: calling each VML
function once that way, before the model runs, settles every dispatch with no concurrent
first call (the fix proposed upstream, pytorch/pytorch#188791, does the same inside ATen).
"""

from __future__ import annotations

import torch

VML_OPS = (
    "acos",
    "asin",
    "atan",
    "cos",
    "erf",
    "erfc",
    "erfinv",
    "exp",
    "log",
    "log10",
    "log2",
    "sin",
    "sqrt",
    "tan",
    "tanh",
    "trunc",
)
"""The torch unary ops ATen sends to MKL VML (aten/src/ATen/cpu/vml.h, IMPLEMENT_VML_MKL)."""

VML_DTYPES = (torch.float32, torch.float64)
"""VML's precisions (vms*, vmd*); each function resolves its dispatch per precision."""


def warm_vector_math() -> None:
    """Call every VML function once per precision on one element (on this thread alone).

    Idempotent and cheap (microseconds); a torch without MKL just runs the ops."""
    for dtype in VML_DTYPES:
        x = torch.full((1,), 0.5, dtype=dtype)
        for name in VML_OPS:
            getattr(torch, name)(x)
