"""Greedy generation with penalties and logit_bias in float32 equals HF transformers (+ PEFT)
`generate`, token for token, for the base model and an adapter, with every request of a
run batched together (penalised rows beside plain ones).

repetition_penalty is HF's own (`generate(repetition_penalty=p)`); logit_bias, presence
and frequency are OpenAI's formulas in a LogitsProcessor written here."""

from __future__ import annotations

import json

import pytest
import torch

from deploy.cli import main
from lora_core.errors import InvalidRequest
from replica.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy
from tests.tiny import run_requests
from tests.unit.replica.engines import small_engine

PROMPTS = ["hello world hello world hello", "the quick brown fox jumps over the lazy dog"]
MAX_NEW = 12


def openai_processors(prompt_len: int, bias: dict[int, float], presence: float, frequency: float):
    """HF LogitsProcessors of OpenAI's logit_bias and presence / frequency penalties (over
    the generated tokens only), one token at a time. `generate` runs its own repetition
    penalty before these, as vLLM does for presence / frequency; vLLM biases before the
    repetition penalty, so the cases never combine bias and repetition here."""
    from transformers import LogitsProcessor

    class Bias(LogitsProcessor):
        def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
            scores = scores.clone()
            for j, b in bias.items():
                scores[:, j] += b
            return scores

    class Penalties(LogitsProcessor):
        def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
            scores = scores.clone()
            for row, ids in enumerate(input_ids.tolist()):
                generated = ids[prompt_len:]
                for j in set(generated):
                    count = generated.count(j)
                    scores[row, j] -= presence * (count > 0) + frequency * count
            return scores

    return [Bias(), Penalties()]


def hf_generate(
    model_dir,
    adapter_path,
    prompt_ids: list[int],
    repetition_penalty: float = 1.0,
    logit_bias: dict[int, float] | None = None,
    presence: float = 0.0,
    frequency: float = 0.0,
) -> list[int]:
    import transformers

    assert not (logit_bias and repetition_penalty != 1.0)  # see openai_processors
    processors = openai_processors(len(prompt_ids), logit_bias or {}, presence, frequency)
    return hf_greedy(
        model_dir,
        adapter_path,
        prompt_ids,
        max_new_tokens=MAX_NEW,
        repetition_penalty=repetition_penalty,
        logits_processor=transformers.LogitsProcessorList(processors),
    )


CASES = {
    "repetition 1.3": (dict(repetition_penalty=1.3), dict(repetition_penalty=1.3)),
    "repetition 2": (dict(repetition_penalty=2.0), dict(repetition_penalty=2.0)),
    "repetition 0.7": (dict(repetition_penalty=0.7), dict(repetition_penalty=0.7)),
    "presence": (dict(presence_penalty=2.0), dict(presence=2.0)),
    "frequency -1": (dict(frequency_penalty=-1.0), dict(frequency=-1.0)),
    "presence + frequency": (
        dict(presence_penalty=1.5, frequency_penalty=0.75),
        dict(presence=1.5, frequency=0.75),
    ),
    "all penalties": (
        dict(presence_penalty=-0.5, frequency_penalty=2.0, repetition_penalty=1.5),
        dict(presence=-0.5, frequency=2.0, repetition_penalty=1.5),
    ),
    "bias + frequency": (
        dict(logit_bias={5: 3.0, 40: -100.0, 7: 2.5}, frequency_penalty=1.0),
        dict(logit_bias={5: 3.0, 40: -100.0, 7: 2.5}, frequency=1.0),
    ),
}


@pytest.mark.parametrize("adapter", [None, "all16rs"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_penalties_equals_hf(llama_dir, llama_adapters, refs, adapter, case):
    ours, theirs = CASES[case]
    engine = small_engine(llama_dir)
    ref = refs[adapter] if adapter else None
    path = llama_adapters[adapter] if adapter else None
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, **ours)
    plain = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    reqs = [(f"p{i}", prompt, params, ref) for i, prompt in enumerate(PROMPTS)]
    reqs += [(f"plain{i}", prompt, plain, ref) for i, prompt in enumerate(PROMPTS)]
    got = run_requests(engine, reqs)
    for i, prompt in enumerate(PROMPTS):
        ids = engine.tokenizer(prompt).input_ids
        assert got[f"p{i}"] == hf_generate(llama_dir, path, ids, **theirs), (case, prompt)
        assert got[f"plain{i}"] == hf_generate(llama_dir, path, ids)
    # the penalties must change some output, or this test could not fail
    assert any(got[f"p{i}"] != got[f"plain{i}"] for i in range(len(PROMPTS)))


def test_a_biased_token_outside_the_vocabulary_is_refused(llama_dir):
    engine = small_engine(llama_dir)
    vocab = engine.vocab_size
    params = SamplingParams(logit_bias={3: 1.0, vocab: 1.0})
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("r", [1, 2], params)
    assert str(e.value) == (
        f"logit_bias: token id {vocab} out of range; allowed: token ids 0 <= id < {vocab}"
    )
    assert e.value.param == "logit_bias" and not engine.has_unfinished()
    engine.add_request("ok", [1, 2], SamplingParams(max_tokens=1, logit_bias={vocab - 1: 1.0}))


def test_offline_lines_take_the_same_fields(tmp_path, llama_dir, llama_adapters):
    """`lorafleet generate` reads the fields under REST's names (logit_bias in OpenAI's
    shape) and answers as HF does."""
    fields = dict(presence_penalty=1.5, frequency_penalty=-0.5, logit_bias={"5": 3.0, "7": 2.5})
    rows = [
        {"prompt": PROMPTS[0], "adapter": "qv8", "max_tokens": MAX_NEW, **fields},
        {"prompt": PROMPTS[1], "adapter": None, "max_tokens": MAX_NEW, "repetition_penalty": 1.5},
    ]
    inp, outp = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["generate", "--model", str(llama_dir), "--adapter", f"qv8={llama_adapters['qv8']}"]
    assert main([*args, "--input", str(inp), "--output", str(outp), "--quiet"]) == 0
    out = [json.loads(line)["token_ids"] for line in outp.read_text().splitlines()]
    tok = small_engine(llama_dir).tokenizer
    bias = {5: 3.0, 7: 2.5}
    ids = [tok(p).input_ids for p in PROMPTS]
    assert out == [
        hf_generate(
            llama_dir, llama_adapters["qv8"], ids[0], logit_bias=bias, presence=1.5, frequency=-0.5
        ),
        hf_generate(llama_dir, None, ids[1], repetition_penalty=1.5),
    ]
