"""A small CPU engine for the engine tests."""

from __future__ import annotations

from replica.config import EngineConfig
from replica.engine import LLMEngine


def small_engine(model_dir, **overrides) -> LLMEngine:
    """A CPU engine with 2 GPU slots, 4 CPU-cached adapters, rank <= 16 and 4-token blocks
    (few slots and small blocks, so tests reach eviction and block boundaries quickly)."""
    cfg = dict(
        model=str(model_dir),
        device="cpu",
        max_loras=2,
        max_cpu_loras=4,
        max_lora_rank=16,
        block_size=4,
    )
    return LLMEngine(EngineConfig(**{**cfg, **overrides}))
