"""CPU kernel tests run the Triton kernels in the interpreter: it must be on before import."""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def triton_backend(monkeypatch):
    """LORAFLEET_KERNELS=triton for one test (CPU tensors -> interpreted Triton kernels)."""
    monkeypatch.setenv("LORAFLEET_KERNELS", "triton")
