"""REST's penalties, logit_bias and top_k (completions and chat): OpenAI's shapes and
vLLM's extensions reach SamplingParams as sent; bad values are 400s naming the field."""

import pytest

from lora_core.errors import InvalidRequest
from replica.logit_bias import LOGIT_BIAS_ALLOWED
from replica.sampling_params import SamplingParams
from router.body_parse import parse_body
from router.openai_protocol import ChatCompletionRequest, CompletionRequest

USER = [{"role": "user", "content": "x"}]
BODIES = {
    CompletionRequest: {"model": "a", "prompt": "x", "max_tokens": 4},
    ChatCompletionRequest: {"model": "a", "messages": USER, "max_tokens": 4},
}
KEY_ALLOWED = 'allowed: keys that are token ids written as decimal integers ("50256")'


def sampling(model, **fields) -> SamplingParams:
    req = parse_body(model, {**BODIES[model], **fields})
    if model is ChatCompletionRequest:
        return req.to_sampling_params(1000)
    return req.to_sampling_params()


@pytest.mark.parametrize("model", list(BODIES))
def test_fields_reach_sampling_params(model):
    got = sampling(
        model,
        presence_penalty=-2,
        frequency_penalty=1.5,
        repetition_penalty=1.2,
        top_k=40,
        logit_bias={"50": -100, "7": 2.5, "0": 100},
    )
    assert got == SamplingParams(
        max_tokens=4,
        presence_penalty=-2.0,
        frequency_penalty=1.5,
        repetition_penalty=1.2,
        top_k=40,
        logit_bias=((0, 100.0), (7, 2.5), (50, -100.0)),
    )


@pytest.mark.parametrize("model", list(BODIES))
@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"top_k": -1},
        {"top_k": 0, "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0},
        {"top_k": None, "logit_bias": None, "repetition_penalty": None, "presence_penalty": None},
        {"repetition_penalty": 1},
    ],
)
def test_neutral_values_mean_off(model, fields):
    got = sampling(model, **fields)
    assert got == SamplingParams(max_tokens=4) and not got.processes_logits


@pytest.mark.parametrize("model", list(BODIES))
@pytest.mark.parametrize(
    "fields, message",
    [
        ({"presence_penalty": 2.5}, "presence_penalty=2.5; allowed: a number -2 <= "),
        ({"presence_penalty": "1"}, "presence_penalty: got a string; allowed: a number"),
        ({"presence_penalty": True}, "presence_penalty: got a boolean (true); allowed: a number"),
        ({"frequency_penalty": -3}, "frequency_penalty=-3.0; allowed: a number -2 <= "),
        ({"repetition_penalty": 0}, "repetition_penalty=0.0; allowed: a number 0 < "),
        ({"repetition_penalty": 2.01}, "repetition_penalty=2.01; allowed: a number 0 < "),
        ({"repetition_penalty": "1.2"}, "repetition_penalty: got a string; allowed: a number"),
        ({"top_k": -2}, "top_k=-2; allowed: an integer >= 0 (0 = off), or -1 (off, as in vLLM)"),
        ({"top_k": 2.0}, "top_k: got a number (2.0); allowed: an integer"),
        ({"top_k": "2"}, "top_k: got a string; allowed: an integer"),
        ({"logit_bias": {"abc": 1}}, f"logit_bias: key 'abc' is no token id; {KEY_ALLOWED}"),
        ({"logit_bias": {"-5": 1}}, f"logit_bias: key '-5' is no token id; {KEY_ALLOWED}"),
        ({"logit_bias": {"1.5": 1}}, f"logit_bias: key '1.5' is no token id; {KEY_ALLOWED}"),
        ({"logit_bias": {"1" * 5000: 1}}, "logit_bias: key '11111111111111111111...' (5000 "),
        ({"logit_bias": {"5": 101}}, f"logit_bias: bias 101.0 for token 5; {LOGIT_BIAS_ALLOWED}"),
        ({"logit_bias": {"5": 1, "05": 2}}, "logit_bias: keys '5' and '05' are both token id 5; "),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias: 301 token ids; "),
        ({"logit_bias": [[5, 1]]}, "logit_bias: got a list; allowed: an object"),
    ],
)
def test_bad_values_are_refused_naming_the_field(model, fields, message):
    with pytest.raises(InvalidRequest) as e:
        sampling(model, **fields)
    assert str(e.value).startswith(message)
    assert e.value.param == next(iter(fields))


@pytest.mark.parametrize("model", list(BODIES))
def test_a_bias_that_is_no_number_names_its_key(model):
    with pytest.raises(InvalidRequest) as e:
        sampling(model, logit_bias={"5": "1"})
    assert (str(e.value), e.value.param) == (
        "logit_bias.5: got a string; allowed: a number",
        "logit_bias.5",
    )
