"""Session-wide fixtures: tiny models and PEFT adapters built once per test run."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# On a machine without CUDA the Triton kernels can only run in Triton's interpreter, and
# Triton reads this when it is first imported (transformers/peft may import it early).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tests.tiny import ADAPTER_SPECS, make_peft_adapter, make_tiny_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def llama_dir(tiny_dir) -> Path:
    return make_tiny_model(tiny_dir / "llama", "llama", seed=1)


@pytest.fixture(scope="session")
def qwen2_dir(tiny_dir) -> Path:
    return make_tiny_model(tiny_dir / "qwen2", "qwen2", seed=2)


def _adapters(model_dir: Path, root: Path) -> dict[str, Path]:
    return {
        name: make_peft_adapter(model_dir, root / name, seed=10 + i, **spec)
        for i, (name, spec) in enumerate(ADAPTER_SPECS.items())
    }


@pytest.fixture(scope="session")
def llama_adapters(llama_dir, tiny_dir) -> dict[str, Path]:
    return _adapters(llama_dir, tiny_dir / "llama-adapters")


@pytest.fixture(scope="session")
def qwen2_adapters(qwen2_dir, tiny_dir) -> dict[str, Path]:
    return _adapters(qwen2_dir, tiny_dir / "qwen2-adapters")
