"""Structured outputs on CUDA: the masks are unpacked and applied on the device (inside a
step whose decode runs from CUDA graphs); float32 greedy tokens equal the CPU engine's,
which equal HF + PEFT (tests/unit/replica/test_structured_vs_hf.py)."""

from __future__ import annotations

import json

import pytest
import torch

from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.offline import adapter_ref
from replica.sampling_params import SamplingParams
from replica.structured import unpack_bitmask
from replica.structured_spec import FREE_WHITESPACE, StructuredOutput

pytestmark = pytest.mark.gpu

SCHEMA = {
    "type": "object",
    "properties": {"c": {"enum": ["red", "green"]}, "n": {"type": "integer"}},
}
SPECS = [
    StructuredOutput("json", json.dumps(SCHEMA)),
    StructuredOutput("regex", r"[a-z]{2,5}( [a-z]{2,5}){0,2}"),
    StructuredOutput("choice", ("alpha", "beta", "gamma")),
    StructuredOutput("json_object"),
    StructuredOutput("json", json.dumps(SCHEMA), FREE_WHITESPACE),
]


def _run(model_dir, ref, device: str) -> dict[str, list[int]]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), device=device, dtype="float32",
                                    max_loras=2, max_lora_rank=16))  # fmt: skip
    for i, spec in enumerate(SPECS):
        for r, adapter in (("base", None), ("lora", ref)):
            params = SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=spec)
            engine.add_request(
                f"{i}-{r}", engine.tokenizer("hello world").input_ids, params, adapter
            )
    engine.add_request("free", engine.tokenizer("hello").input_ids,
                       SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))  # fmt: skip
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    engine.close()
    return out


def test_cuda_structured_greedy_equals_cpu(llama_dir, llama_adapters):
    ref = adapter_ref("qv8", llama_adapters["qv8"], 16)
    assert _run(llama_dir, ref, "cuda") == _run(llama_dir, ref, "cpu")


def test_unpack_bitmask_on_cuda_equals_cpu():
    bits = torch.randint(-(2**31), 2**31 - 1, (64, 4008), dtype=torch.int32)
    want = unpack_bitmask(bits, 128256)
    assert torch.equal(unpack_bitmask(bits.cuda(), 128256).cpu(), want)
