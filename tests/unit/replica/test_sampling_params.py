"""SamplingParams' penalties, logit_bias, top_k and truncate_prompt_tokens: accepted values are normalised, refused
ones name the field and what is allowed."""

import pytest

from lora_core.errors import InvalidRequest
from replica.logit_bias import LOGIT_BIAS_ALLOWED, logit_bias_of_json
from replica.prompt_truncation import TRUNCATE_ALLOWED, kept_prompt
from replica.sampling_params import SamplingParams

KEY_ALLOWED = 'keys that are token ids written as decimal integers ("50256")'

PENALTY = "allowed: a number -2 <= {0} <= 2 (0 = off)"
REPETITION = "allowed: a number 0 < repetition_penalty <= 2 (1 = off)"


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("presence_penalty", 2.5, "presence_penalty=2.5; " + PENALTY.format("presence_penalty")),
        (
            "presence_penalty",
            -2.01,
            "presence_penalty=-2.01; " + PENALTY.format("presence_penalty"),
        ),
        ("presence_penalty", float("nan"), "presence_penalty=nan; "),
        ("presence_penalty", True, "presence_penalty=True; "),
        ("frequency_penalty", "1", "frequency_penalty='1'; " + PENALTY.format("frequency_penalty")),
        ("frequency_penalty", float("inf"), "frequency_penalty=inf; "),
        ("repetition_penalty", 0, "repetition_penalty=0; " + REPETITION),
        ("repetition_penalty", -1.0, "repetition_penalty=-1.0; " + REPETITION),
        ("repetition_penalty", 2.5, "repetition_penalty=2.5; " + REPETITION),
        ("repetition_penalty", None, "repetition_penalty=None; " + REPETITION),
        ("top_k", -2, "top_k=-2; allowed: an integer >= 0 (0 = off), or -1 (off, as in vLLM)"),
        ("top_k", 1.0, "top_k=1.0; allowed: an integer >= 0"),
        ("logit_bias", ((5, 101.0),), f"logit_bias: bias 101.0 for token 5; {LOGIT_BIAS_ALLOWED}"),
        ("logit_bias", ((5, -100.5),), "logit_bias: bias -100.5 for token 5; "),
        ("logit_bias", ((5, "1"),), "logit_bias: bias '1' for token 5; "),
        ("logit_bias", ((5, float("nan")),), "logit_bias: bias nan for token 5; "),
        ("logit_bias", ((-1, 1.0),), f"logit_bias: token id -1; {LOGIT_BIAS_ALLOWED}"),
        ("logit_bias", ((True, 1.0),), "logit_bias: token id True; "),
        ("logit_bias", ((5, 1.0), (5, 2.0)), "logit_bias: token id 5 given twice; "),
        ("logit_bias", ((5,),), "logit_bias: (5,) is no (token id, bias) pair; "),
        ("logit_bias", "5", f"logit_bias: got str; {LOGIT_BIAS_ALLOWED}"),
        ("logit_bias", {i: 1.0 for i in range(301)}, "logit_bias: 301 token ids; "),
        ("truncate_prompt_tokens", 0, f"truncate_prompt_tokens=0; {TRUNCATE_ALLOWED}"),
        ("truncate_prompt_tokens", -2, "truncate_prompt_tokens=-2; allowed: null (off), "),
        ("truncate_prompt_tokens", 2.0, "truncate_prompt_tokens=2.0; "),
        ("truncate_prompt_tokens", True, "truncate_prompt_tokens=True; "),
    ],
)
def test_bad_values_name_the_field_and_what_is_allowed(field, value, message):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**{field: value})
    assert str(e.value).startswith(message)
    assert e.value.param == field


def test_allowed_values_are_normalised():
    p = SamplingParams(
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=2,
        top_k=-1,
        logit_bias={9: -100, 3: 100, 0: 0},
    )
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (-2.0, 2.0, 2.0)
    assert type(p.presence_penalty) is float and type(p.repetition_penalty) is float
    assert p.top_k == 0
    assert p.logit_bias == ((0, 0.0), (3, 100.0), (9, -100.0))
    assert SamplingParams(logit_bias=[(i, 1) for i in range(300)]).processes_logits
    assert SamplingParams(repetition_penalty=1e-9).penalised


@pytest.mark.parametrize(
    "fields, processes, penalised",
    [
        ({}, False, False),
        ({"presence_penalty": 0.0, "frequency_penalty": 0, "repetition_penalty": 1}, False, False),
        ({"logit_bias": {1: 0.0}}, True, False),
        ({"frequency_penalty": -0.1}, True, True),
        ({"repetition_penalty": 1.01}, True, True),
    ],
)
def test_which_requests_process_logits(fields, processes, penalised):
    p = SamplingParams(**fields)
    assert (p.processes_logits, p.penalised) == (processes, penalised)


def test_openai_logit_bias_keys_are_decimal_token_ids():
    assert logit_bias_of_json({"50256": -100, "7": 1.5}) == ((50256, -100), (7, 1.5))
    for key in ("abc", "-1", "1.0", " 1", "", "\u0663"):
        with pytest.raises(InvalidRequest) as e:
            logit_bias_of_json({key: 1})
        assert str(e.value).startswith(f"logit_bias: key {key!r} is no token id; allowed: ")
        assert e.value.param == "logit_bias"


def test_logit_bias_keys_of_many_digits_are_refused_not_a_crash():
    # Python refuses to convert a decimal string of more than 4300 digits (ValueError):
    # such a key was a 500 on REST and a message without its line offline.
    assert logit_bias_of_json({"0" * 5000 + "5": 1}) == ((5, 1),)
    for key in ("1" * 5000, "9" * 20):
        with pytest.raises(InvalidRequest) as e:
            logit_bias_of_json({key: 1})
        assert str(e.value) == (
            f"logit_bias: key '{key[:20]}...' ({len(key)} digits) is no token id of any "
            f"vocabulary; allowed: {KEY_ALLOWED}"
        )
        assert e.value.param == "logit_bias"


@pytest.mark.parametrize(
    "k, ids, kept",
    [
        (None, [5, 6, 7], [5, 6, 7]),
        (2, [5, 6, 7], [6, 7]),
        (3, (5, 6, 7), (5, 6, 7)),
        (9, [5, 6, 7], [5, 6, 7]),
        (1, (5, 6, 7), (7,)),
        (-1, list(range(12)), list(range(2, 12))),  # -1: the context's length (10 here)
        (10, list(range(12)), list(range(2, 12))),
    ],
)
def test_a_truncated_prompt_keeps_its_last_k_tokens(k, ids, kept):
    assert kept_prompt(ids, k, 10) == kept
    assert SamplingParams(truncate_prompt_tokens=k).kept_prompt(ids, 10) == kept


@pytest.mark.parametrize("k, message", [(11, "truncate_prompt_tokens=11: more than"), (0, "")])
def test_a_truncation_beyond_the_context_or_out_of_range_is_refused(k, message):
    with pytest.raises(InvalidRequest) as e:
        kept_prompt([1, 2], k, 10)
    assert str(e.value).startswith(message or f"truncate_prompt_tokens=0; {TRUNCATE_ALLOWED}")
    assert e.value.param == "truncate_prompt_tokens"
