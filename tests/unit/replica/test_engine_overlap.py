"""EngineConfig.lora_overlap: the shrink on a side stream beside the base GEMM. It needs
CUDA streams, so the CPU tests check the option's refusal and that no stream is made off
CUDA; tests/gpu/test_engine_cuda.py runs it on a GPU against the CPU engine (eager and
in CUDA graphs)."""

from __future__ import annotations

import pytest
import torch

from lora_core.context import LoraBatchContext
from lora_core.errors import InvalidRequest
from replica.config import EngineConfig


def test_overlap_and_stacked_are_refused_together(llama_dir):
    with pytest.raises(InvalidRequest, match="lora_stacked with lora_overlap"):
        EngineConfig(model=str(llama_dir), lora_stacked=True, lora_overlap=True)


def test_no_side_stream_off_cuda():
    ctx = LoraBatchContext(8, "cpu", torch.zeros(2, dtype=torch.int32), 4, overlap=True)
    assert ctx.side_stream is None
