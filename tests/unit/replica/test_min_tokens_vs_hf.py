"""min_tokens and stop_token_ids in float32 greedy generation equal HF transformers (+ PEFT)
`generate(min_new_tokens=m, eos_token_id=[...])`, token for token: below min_tokens a stop
token is not sampled (its logit is -inf, HF's MinNewTokensLengthLogitsProcessor), after it
the first one ends the request (its id is the last token, its text left out), batched
beside requests without them."""

from __future__ import annotations

import pytest

from lora_core.errors import InvalidRequest
from replica.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy
from tests.tiny import run_requests
from tests.unit.replica.engines import small_engine

PROMPT = "the quick brown fox jumps over the lazy dog"
MAX_NEW = 10


@pytest.mark.parametrize("adapter", [None, "qv8"])
@pytest.mark.parametrize("min_tokens", [0, 3, 6])
def test_min_tokens_and_stop_token_ids_equal_hf(
    llama_dir, llama_adapters, refs, adapter, min_tokens
):
    engine = small_engine(llama_dir)
    ref = refs[adapter] if adapter else None
    free = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    plain = run_requests(engine, [("free", PROMPT, free, ref)])["free"]
    # the tokens greedy picks 2nd and 4th become stop tokens (EOS stays off: ignore_eos)
    stops = (plain[1], plain[3])
    params = SamplingParams(
        max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, stop_token_ids=stops,
        min_tokens=min_tokens,
    )  # fmt: skip
    got = run_requests(engine, [("min", PROMPT, params, ref), ("beside", PROMPT, free, ref)])
    ids = engine.tokenizer(PROMPT).input_ids
    path = llama_adapters[adapter] if adapter else None
    want = hf_greedy(
        llama_dir, path, ids, max_new_tokens=MAX_NEW, min_new_tokens=min_tokens,
        eos_token_id=list(stops),
    )  # fmt: skip
    assert got["min"] == want
    assert got["beside"] == plain  # the ban is the row's own
    assert all(t not in stops for t in got["min"][:min_tokens])
    assert got["min"][-1] in stops or len(got["min"]) == MAX_NEW


def test_stop_strings_wait_for_min_tokens(llama_dir):
    engine = small_engine(llama_dir)
    free = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    whole = engine.tokenizer.decode(run_requests(engine, [("f", PROMPT, free, None)])["f"])
    stop = whole[:2]  # found at once without min_tokens
    early = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, stop=(stop,))
    late = SamplingParams(
        max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, stop=(stop,), min_tokens=MAX_NEW
    )
    got = run_requests(engine, [("early", PROMPT, early, None), ("late", PROMPT, late, None)])
    assert len(got["early"]) < MAX_NEW and len(got["late"]) == MAX_NEW


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens=5 with max_tokens=4; allowed: an integer 0 <= min_tokens <= max_tokens"),
        ({"min_tokens": -1}, "min_tokens=-1"),
        ({"min_tokens": True}, "min_tokens=True"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids: allowed: a list of at most 64 token ids (integers >= 0); got [1, -2]"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids: allowed: a list of at most 64"),
        ({"stop_token_ids": "12"}, "stop_token_ids: allowed"),
    ],
)  # fmt: skip
def test_bad_fields_are_refused_naming_them(fields, message):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**fields)
    assert str(e.value).startswith(message) and e.value.param == next(iter(fields))


def test_a_stop_token_id_outside_the_vocabulary_is_refused(llama_dir):
    engine = small_engine(llama_dir)
    vocab = engine.vocab_size
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("r", [1, 2], SamplingParams(stop_token_ids=(3, vocab)))
    assert (str(e.value), e.value.param) == (
        f"stop_token_ids: token id {vocab} out of range; allowed: token ids 0 <= id < {vocab}",
        "stop_token_ids",
    )
