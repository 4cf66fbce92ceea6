"""allowed_token_ids in float32 greedy generation equal HF transformers (+ PEFT)
`generate(logits_processor=[mask])`, token for token, where the mask sets every logit
outside the set to -inf (vLLM's semantics), batched beside requests without it; with
logit_bias and min_tokens on the same row, and min_p, which greedy ignores."""

from __future__ import annotations

import pytest
import torch

from lora_core.errors import InvalidRequest
from replica.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy
from tests.tiny import run_requests
from tests.unit.replica.engines import small_engine

PROMPT = "the quick brown fox jumps over the lazy dog"
MAX_NEW = 10


class AllowedOnly:
    """An HF logits processor: every token outside `allowed` gets -inf."""

    def __init__(self, allowed: list[int]):
        self.allowed = torch.tensor(allowed)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        mask = torch.ones_like(scores, dtype=torch.bool)
        mask[:, self.allowed] = False
        return scores.masked_fill(mask, float("-inf"))


class Bias:
    def __init__(self, bias: dict[int, float]):
        self.bias = bias

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for t, b in self.bias.items():
            scores[:, t] += b
        return scores


@pytest.mark.parametrize("adapter", [None, "qv8"])
@pytest.mark.parametrize("case", ["allowed", "allowed+bias", "min_p"])
def test_greedy_allowed_token_ids_equal_hf(llama_dir, llama_adapters, refs, adapter, case):
    from transformers import LogitsProcessorList

    engine = small_engine(llama_dir)
    ref = refs[adapter] if adapter else None
    free = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    plain = run_requests(engine, [("free", PROMPT, free, ref)])["free"]
    # greedy's 1st and 3rd picks are left out, so the answer must change (10 tokens: EOS
    # is not among the first 10 greedy picks here, nor among them with the mask)
    allowed = sorted({*range(5, 380, 7), plain[1], plain[4]} - {plain[0], plain[2]})
    fields: dict = {"allowed_token_ids": allowed}
    processors = [AllowedOnly(allowed)]
    if case == "allowed+bias":
        bias = {allowed[3]: 3.0, plain[0]: 50.0}  # a bias outside the set stays masked
        fields["logit_bias"] = bias
        processors = [Bias(bias), AllowedOnly(allowed)]
    if case == "min_p":
        fields = {"min_p": 0.9}
        processors = []
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, **fields)
    got = run_requests(engine, [("masked", PROMPT, params, ref), ("beside", PROMPT, free, ref)])
    ids = engine.tokenizer(PROMPT).input_ids
    path = llama_adapters[adapter] if adapter else None
    want = hf_greedy(
        llama_dir, path, ids, max_new_tokens=MAX_NEW,
        logits_processor=LogitsProcessorList(processors),
    )  # fmt: skip
    assert got["masked"] == want
    assert got["beside"] == plain  # the mask is the row's own
    if case == "min_p":
        assert want == plain
    else:
        assert want != plain and set(want) <= set(allowed) and len(want) == MAX_NEW


def test_out_of_vocabulary_ids_and_an_all_stopping_set_are_refused(llama_dir):
    engine = small_engine(llama_dir)
    vocab = engine.vocab_size
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("r", [1, 2], SamplingParams(allowed_token_ids=(3, vocab)))
    assert (str(e.value), e.value.param) == (
        f"allowed_token_ids: token id {vocab} out of range; allowed: token ids 0 <= id < {vocab}",
        "allowed_token_ids",
    )
    eos = min(engine.eos_ids)
    stops = SamplingParams(allowed_token_ids=(eos, 7), stop_token_ids=(7,), min_tokens=1)
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("r", [1, 2], stops)
    assert str(e.value).startswith("allowed_token_ids: every allowed token ends the request")
    assert e.value.param == "allowed_token_ids"
    # min_tokens 0, or EOS ignored: a token is left to sample
    engine.add_request("a", [1, 2], SamplingParams(allowed_token_ids=(eos, 7), stop_token_ids=(7,)))
    engine.add_request(
        "b", [1, 2], SamplingParams(allowed_token_ids=(eos,), min_tokens=1, ignore_eos=True)
    )
