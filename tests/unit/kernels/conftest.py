"""CPU kernel tests run the Triton kernels in the interpreter: it must be on before import."""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def triton_backend(monkeypatch):
    """LORAFLEET_KERNELS=triton for one test (CPU tensors -> interpreted Triton kernels)."""
    monkeypatch.setenv("LORAFLEET_KERNELS", "triton")


@pytest.fixture
def poisoned():
    """New tensors from torch.empty hold NaN / the integer maximum for one test (torch's
    deterministic mode fills uninitialised memory), so an output element or a row that no
    kernel wrote shows up instead of passing on a lucky zero."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)
