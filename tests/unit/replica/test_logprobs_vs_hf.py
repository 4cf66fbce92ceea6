"""Engine logprobs and top logprobs in float32 equal log_softmax(logits).topk(k) of an HF
transformers (+ PEFT) forward over the same tokens, for base and adapter requests
batched with a request that asks for no logprobs."""

from __future__ import annotations

import pytest
import torch

from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.offline import adapter_ref
from replica.sampling_params import SamplingParams
from tests.hf_reference import hf_logp

PROMPTS = ["hello world how are you", "the quick brown fox jumps over"]
K = 5
MAX_NEW = 6


def _run(engine: LLMEngine, requests) -> dict[str, dict[str, list]]:
    for rid, prompt, params, ref in requests:
        engine.add_request(rid, engine.tokenizer(prompt).input_ids, params, ref)
    got = {rid: {"ids": [], "lps": [], "top": []} for rid, *_ in requests}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id]["ids"] += o.new_token_ids
            got[o.request_id]["lps"] += o.new_logprobs
            got[o.request_id]["top"] += o.new_top_logprobs
    return got


@pytest.mark.parametrize("adapter", [None, "qv8"])
def test_top_logprobs_equal_hf_reference(llama_dir, llama_adapters, adapter):
    cfg = EngineConfig(model=str(llama_dir), device="cpu", max_loras=2, max_lora_rank=16)
    engine = LLMEngine(cfg)
    ref = adapter_ref(adapter, llama_adapters[adapter], max_rank=16) if adapter else None
    asked = SamplingParams(
        max_tokens=MAX_NEW, temperature=0.8, seed=3, logprobs=True, top_logprobs=K, ignore_eos=True
    )
    plain = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    got = _run(engine, [("asked", PROMPTS[0], asked, ref), ("plain", PROMPTS[1], plain, ref)])
    assert got["plain"]["lps"] == [] and got["plain"]["top"] == []

    prompt = engine.tokenizer(PROMPTS[0]).input_ids
    out = got["asked"]
    assert len(out["ids"]) == len(out["lps"]) == len(out["top"]) == MAX_NEW
    path = llama_adapters[adapter] if adapter else None
    logp = hf_logp(llama_dir, path, prompt + out["ids"])[len(prompt) - 1 : -1]
    picked = logp[torch.arange(MAX_NEW), out["ids"]]
    assert out["lps"] == pytest.approx(picked.tolist(), abs=1e-4)
    values, ids = logp.topk(K, dim=-1)
    assert [[t for t, _ in row] for row in out["top"]] == ids.tolist()
    assert [[lp for _, lp in row] for row in out["top"]] == [
        pytest.approx(v, abs=1e-4) for v in values.tolist()
    ]
