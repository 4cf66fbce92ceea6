"""vLLM's prompt_logprobs on REST over a real Frontend (fake registry, the scripted
engine of test_rest_echo): completions put each prompt's scores on its choices, chat on
the response; they are the scores echo + logprobs shows, asked of the engine once per
prompt (with the larger k when echo asks too); max_tokens 0 scores the prompt only; k > 0
with stream, -1 and k > 20 are 400s naming the field, 0 with stream returns nothing (as
in vLLM), and a request without the field answers as before."""

import asyncio
import json

import pytest

from lora_core.errors import InvalidRequest
from router import rest
from router.body_parse import parse_body
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from tests.unit.router.test_frontend_auth import make_front, tokenizer
from tests.unit.router.test_rest_echo import PROMPT, EngineLike, answer

__all__ = ["tokenizer"]  # the module fixture, shared


def score(ids, i) -> float:
    return -(ids[i] % 7 + i) / 10  # differs by prompt and position


def expected(tokenizer, ids, k) -> list:
    """What EngineLike's scores of ids are in vLLM's shape: token i ranks i + 1, its top
    tokens are (i, -0.1) k times: one key, whose last rank (k) stands."""
    want = [None]
    for i in range(1, len(ids)):
        entry = {str(ids[i]): {"logprob": score(ids, i), "rank": i + 1}}
        if k:
            entry[str(i)] = {"logprob": -0.1, "rank": k}
        for token, value in entry.items():
            value["decoded_token"] = tokenizer.decode([int(token)])
        want.append(entry)
    return want


@pytest.mark.parametrize("prompt", [PROMPT, "prompt ids"])
def test_completion_choices_carry_the_scores_echo_shows(tokenizer, prompt):
    ids = tokenizer(PROMPT).input_ids
    prompt = PROMPT if prompt == PROMPT else ids
    body = {"model": "a2", "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 1}
    got, calls = answer(tokenizer, body, EngineLike(score))
    assert calls[0].params.prompt_logprobs == 1 and calls[0].params.logprobs is False
    (choice,) = got["choices"]
    assert choice["text"] == "xy" and choice["logprobs"] is None  # no echo: no prompt
    assert choice["prompt_logprobs"] == expected(tokenizer, ids, 1)
    echoed, _ = answer(tokenizer, {**body, "echo": True, "logprobs": 1}, EngineLike(score))
    lp = echoed["choices"][0]["logprobs"]
    scores = zip(choice["prompt_logprobs"], ids, strict=True)
    mine = [e and e[str(t)]["logprob"] for e, t in scores]
    assert mine == lp["token_logprobs"][: len(ids)]


def test_echo_and_prompt_logprobs_each_get_their_own_k(tokenizer):
    ids = tokenizer(PROMPT).input_ids
    body = {"model": "a2", "prompt": PROMPT, "echo": True, "logprobs": 0, "prompt_logprobs": 2}
    got, calls = answer(tokenizer, body, EngineLike(score))
    assert calls[0].params.prompt_logprobs == 2  # the larger k, scored once
    (choice,) = got["choices"]
    assert choice["logprobs"]["top_logprobs"][1] == {choice["logprobs"]["tokens"][1]: score(ids, 1)}
    assert choice["prompt_logprobs"] == expected(tokenizer, ids, 2)
    got, calls = answer(tokenizer, {**body, "logprobs": 3, "prompt_logprobs": 0})
    assert calls[0].params.prompt_logprobs == 3
    assert all(len(e) == 1 for e in got["choices"][0]["prompt_logprobs"][1:])


def test_n_choices_share_the_one_scoring_and_a_batch_scores_each_prompt(tokenizer):
    batch = [tokenizer(PROMPT).input_ids, tokenizer("a b c").input_ids]
    body = {"model": "a2", "prompt": batch, "n": 2, "max_tokens": 0, "prompt_logprobs": 1}
    engine = EngineLike(score)
    got, calls = answer(tokenizer, body, engine)
    assert [c.params.prompt_logprobs for c in calls] == [1, 1, 1, 1]
    assert len(engine.scored_groups) == 2  # one scoring per prompt
    choices = got["choices"]
    assert [c["text"] for c in choices] == [""] * 4
    assert [c["finish_reason"] for c in choices] == ["length"] * 4
    for i, choice in enumerate(choices):
        assert choice["prompt_logprobs"] == expected(tokenizer, batch[i // 2], 1)
    assert got["usage"]["completion_tokens"] == 0


def chat(tokenizer, body: dict, engine: EngineLike):
    front = make_front(tokenizer, engine)
    req = parse_body(ChatCompletionRequest, body)
    response = asyncio.run(rest.chat_completions(front, None, req))
    return json.loads(response.body), engine.calls


def test_chat_puts_the_scores_of_its_templated_prompt_on_the_response(tokenizer):
    messages = [{"role": "user", "content": "hello"}]
    body = {"model": "a2", "messages": messages, "n": 2, "prompt_logprobs": 0, "max_tokens": 2}
    got, calls = chat(tokenizer, body, EngineLike(score))
    ids = calls[0].prompt_token_ids  # the templated prompt
    assert len(ids) > len(tokenizer("hello").input_ids)
    assert got["prompt_logprobs"] == expected(tokenizer, ids, 0)
    assert all("prompt_logprobs" not in c for c in got["choices"])
    plain, calls = chat(tokenizer, {**body, "prompt_logprobs": None}, EngineLike(score))
    assert "prompt_logprobs" not in plain and calls[0].params.prompt_logprobs is None


def test_without_the_field_nothing_is_scored_and_the_body_is_unchanged(tokenizer):
    got, calls = answer(tokenizer, {"model": "a2", "prompt": PROMPT, "max_tokens": 2})
    assert calls[0].params.prompt_logprobs is None
    assert set(got["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}


def test_zero_with_stream_is_accepted_and_not_scored(tokenizer):
    body = {"model": "a2", "prompt": PROMPT, "max_tokens": 2, "stream": True}
    events, calls = answer(tokenizer, {**body, "prompt_logprobs": 0})
    assert calls[0].params.prompt_logprobs is None
    assert "".join(e["choices"][0]["text"] for e in events) == "xy"
    assert all("prompt_logprobs" not in e["choices"][0] for e in events)


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"prompt_logprobs": 1, "stream": True},
            "prompt_logprobs: got 1 with stream: true; allowed: null or 0 with stream: true "
            "(prompt logprobs are not streamed, as in vLLM)",
        ),
        (
            {"prompt_logprobs": -1},
            "prompt_logprobs: -1 (every token of the vocabulary) is not supported; allowed: "
            "null or 0 to 20",
        ),
        ({"prompt_logprobs": 21}, "prompt_logprobs: 21 is out of range; allowed: 0 to 20"),
        ({"prompt_logprobs": -2}, "prompt_logprobs: -2 is out of range; allowed: 0 to 20"),
        ({"prompt_logprobs": "1"}, "prompt_logprobs: got a string; allowed: an integer"),
    ],
)
def test_refused_values_name_the_field(model, fields, message):
    base = (
        {"model": "a", "prompt": "x"}
        if model is CompletionRequest
        else {"model": "a", "messages": [{"role": "user", "content": "x"}]}
    )
    with pytest.raises(InvalidRequest) as e:
        parse_body(model, {**base, **fields})
    assert (str(e.value), e.value.param) == (message, "prompt_logprobs")
