"""vLLM's include_stop_str_in_output, skip_special_tokens and truncate_prompt_tokens in
the engine (what the offline runner and every replica run): kept stop strings and stop
tokens, special tokens spelled in the text, and the prompt's last k tokens as the
whole prompt."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lora_core.errors import InvalidRequest
from replica.sampling_params import SamplingParams
from tests.unit.replica.engines import small_engine

PROMPT = "hello world how are you today"
EOS = 0  # the demo tokenizer's <|endoftext|>


@pytest.fixture(scope="module")
def engine(llama_dir):
    return small_engine(llama_dir, max_model_len=64)


def run(engine, ids, params):
    """(text, token ids, finish_reason, prompt tokens) of one request run to its end."""
    engine.add_request("r", list(ids), params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return (
        "".join(o.new_text for o in outs),
        [t for o in outs for t in o.new_token_ids],
        outs[-1].finish_reason,
        outs[-1].num_prompt_tokens,
    )


@pytest.mark.parametrize("k", [1, 3, 6])
def test_a_truncated_prompt_answers_as_its_last_k_tokens_sent_alone(engine, k):
    ids = engine.tokenizer(PROMPT).input_ids
    assert len(ids) > k
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = run(engine, ids[-k:], greedy)
    cut = run(engine, ids, replace(greedy, truncate_prompt_tokens=k))
    assert cut == alone and cut[3] == k
    assert run(engine, ids, greedy)[1] != alone[1]  # the cut changed the answer


def test_truncation_comes_before_the_length_checks(engine):
    """A prompt longer than the context runs when its kept tokens fit; -1 keeps the
    context's length (then no room is left to generate: refused naming the prompt)."""
    ids = engine.tokenizer(PROMPT).input_ids * 20
    assert len(ids) > engine.max_model_len
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = run(engine, ids[-8:], params)
    assert run(engine, ids, replace(params, truncate_prompt_tokens=8)) == want
    with pytest.raises(InvalidRequest, match=r"prompt \(64 tokens\) \+ max_tokens \(4\)"):
        engine.add_request("x", ids, SamplingParams(max_tokens=4, truncate_prompt_tokens=-1))


@pytest.mark.parametrize("k", [65, 1000])
def test_a_truncation_longer_than_the_context_is_refused(engine, k):
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("x", [1, 2], SamplingParams(truncate_prompt_tokens=k))
    assert e.value.param == "truncate_prompt_tokens"
    assert f"truncate_prompt_tokens={k}: more than the model's context of 64 tokens" in str(e.value)
    assert not engine.has_unfinished()


@pytest.mark.parametrize(("skip", "text"), [(True, ""), (False, "<|endoftext|>" * 3)])
def test_generated_special_tokens_are_text_unless_skipped(engine, skip, text):
    params = SamplingParams(
        max_tokens=3, ignore_eos=True, logit_bias={EOS: 100.0}, skip_special_tokens=skip
    )
    assert run(engine, [5, 6, 7], params)[:3] == (text, [EOS] * 3, "length")


@pytest.mark.parametrize(
    ("keep", "skip", "text"),
    [(False, True, ""), (False, False, ""), (True, True, ""), (True, False, "<|endoftext|>")],
)
def test_the_eos_that_ends_a_request_is_text_only_when_kept_and_not_skipped(
    engine, keep, skip, text
):
    params = SamplingParams(
        max_tokens=3,
        logit_bias={EOS: 100.0},
        include_stop_str_in_output=keep,
        skip_special_tokens=skip,
    )
    assert run(engine, [5, 6, 7], params)[:3] == (text, [EOS], "stop")


def test_a_kept_stop_string_ends_the_text(engine):
    ids = engine.tokenizer(PROMPT).input_ids
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    full = run(engine, ids, greedy)[0]
    stop = full[3:5]
    at = full.find(stop)
    for keep, want in ((False, full[:at]), (True, full[: at + len(stop)])):
        params = replace(greedy, stop=(stop,), include_stop_str_in_output=keep)
        text, _, reason, _ = run(engine, ids, params)
        assert (text, reason) == (want, "stop")
