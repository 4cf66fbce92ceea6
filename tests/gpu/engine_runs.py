"""The engine loop the GPU engine tests share: every prompt with the base and each
adapter in one batch, stepped to the end, with a check that CUDA graphs (decode steps'
and the prefill steps' piecewise ones) were (or were not) replayed."""

from __future__ import annotations

import torch

from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.models.moe import SparseMoE
from replica.sampling_params import SamplingParams
from tests.tiny import run_requests


def run_engine(
    model_dir,
    refs: dict,
    prompts: list[str],
    device: str,
    dtype: str = "float32",
    *,
    graphs: bool = True,
    stacked: bool = False,
    compute: str | None = None,
    max_tokens: int = 12,
    ignore_eos: bool = True,
    moe_path: str | None = None,
) -> dict[str, list[int]]:
    """{"<prompt index>-<adapter name or None>": greedy token ids}. compute: every MoE
    block's path (`SparseMoE.compute`), left as configured when None; moe_path: the path
    every MoE block must resolve it to on this device, unchecked when None."""
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir), device=device, dtype=dtype, max_loras=2, max_cpu_loras=3,
            max_lora_rank=16, cuda_graphs=graphs, lora_stacked=stacked,
        )
    )  # fmt: skip
    probe = torch.zeros(1, device=device)
    for m in engine.runner.model.modules():
        if isinstance(m, SparseMoE):
            m.compute = compute or m.compute
            assert moe_path in (None, m.path(probe)), (m.compute, m.path(probe))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    reqs = [
        (f"{i}-{n}", p, params, refs.get(n)) for i, p in enumerate(prompts) for n in (None, *refs)
    ]
    out = run_requests(engine, reqs)
    replays = engine.runner.graphs.replays if engine.runner.graphs else 0
    assert (replays > 0) == (graphs and device == "cuda"), replays
    # every prompt's prefill step replays the layers' graphs around eager attention
    mixed = engine.runner.mixed.replays if engine.runner.mixed else 0
    assert (mixed > 0) == (graphs and device == "cuda"), mixed
    return out
