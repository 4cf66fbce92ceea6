"""Completions with `echo` over a real Frontend (fake registry, an engine-shaped scripted
dispatch): the prompt comes before each choice's text, once, and with logprobs its
tokens come first in the logprobs, the first with a null logprob and null top, text
offsets running on over the prompt into the completion; max_tokens 0 is allowed only
with echo; the engine is asked for prompt logprobs only when echo wants logprobs; with
`n` choices each echoes the scores of the one the replica computed them for."""

import asyncio
import json

import pytest

from lora_core.errors import ReplicaFailed
from replica.outputs import RequestOutput
from router import rest
from router.body_parse import parse_body
from router.openai_protocol import CompletionRequest
from tests.unit.router.test_frontend_auth import make_front, tokenizer

__all__ = ["tokenizer"]  # the module fixture, shared
PROMPT = "hello world"
GENERATED = [("x", 70), ("y", 71)]  # (text, token id) of each step


class EngineLike:
    """Answers a call as the engine does: prompt logprobs (token i scores score(ids, i),
    by default -i / 10, ranks i + 1, its top tokens (i, -0.1)) with the first output when
    asked, then
    GENERATED, or nothing generated with max_tokens 0. As a replica, it scores the
    prompt for the first call of a group only (`replica.async_engine`), or for the calls
    `scores_for` picks. fail: numbers (1-based) of the calls whose replica dies after
    their first output."""

    def __init__(self, score=lambda ids, i: -i / 10, fail=(), scores_for=None):
        self.calls = []
        self.score = score
        self.fail = set(fail)
        self.scores_for = scores_for
        self.scored_groups = set()

    def scores(self, call) -> bool:
        if call.params.prompt_logprobs is None:
            return False
        if self.scores_for is not None:
            return self.scores_for(call)
        first = call.group not in self.scored_groups
        self.scored_groups.add(call.group)
        return call.group is None or first

    async def __call__(self, call):
        self.calls.append(call)
        dies = len(self.calls) in self.fail
        p, n = call.params, len(call.prompt_token_ids)
        lps = ranks = tops = None
        if self.scores(call):
            lps = [self.score(call.prompt_token_ids, i) for i in range(1, n)]
            ranks = [i + 1 for i in range(1, n)]
            tops = (
                [((i, -0.1),) * p.prompt_logprobs for i in range(1, n)]
                if p.prompt_logprobs
                else None
            )
        if p.max_tokens == 0:
            yield RequestOutput(
                call.request_id,
                finish_reason="length",
                num_prompt_tokens=n,
                prompt_logprobs=lps,
                prompt_ranks=ranks,
                prompt_top_logprobs=tops,
            )
            return
        for step, (text, token) in enumerate(GENERATED):
            last = step == len(GENERATED) - 1
            yield RequestOutput(
                call.request_id,
                [token],
                text,
                new_logprobs=[-1.0] if p.logprobs else [],
                new_top_logprobs=[((token, -1.0),)] if p.top_logprobs else [],
                finish_reason="length" if last else None,
                num_prompt_tokens=n,
                num_output_tokens=step + 1,
                prompt_logprobs=lps if step == 0 else None,
                prompt_ranks=ranks if step == 0 else None,
                prompt_top_logprobs=tops if step == 0 else None,
            )
            if dies:
                raise ReplicaFailed("the replica died")


def answer(tokenizer, body: dict, engine: EngineLike | None = None):
    engine = engine or EngineLike()
    front = make_front(tokenizer, engine)

    async def go():
        response = await rest.completions(front, None, parse_body(CompletionRequest, body))
        if body.get("stream"):
            return b"".join([c async for c in response.body_iterator])
        return response.body

    raw = asyncio.run(go()).decode()
    if not body.get("stream"):
        return json.loads(raw), engine.calls
    datas = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]], engine.calls


def test_echo_with_logprobs_puts_the_scored_prompt_first(tokenizer):
    body, calls = answer(
        tokenizer, {"model": "a2", "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 2}
    )
    ids = tokenizer(PROMPT).input_ids
    assert calls[0].params.prompt_logprobs == 1 and calls[0].params.max_tokens == 2
    (choice,) = body["choices"]
    assert choice["text"] == PROMPT + "xy"
    lp = choice["logprobs"]
    assert lp["tokens"] == [tokenizer.decode([t]) for t in [*ids, 70, 71]]
    assert lp["token_logprobs"] == [None, *(-i / 10 for i in range(1, len(ids))), -1.0, -1.0]
    assert lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1] == {tokenizer.decode([1]): -0.1, lp["tokens"][1]: -0.1}
    assert lp["text_offset"][0] == 0 and lp["text_offset"][len(ids)] == len(PROMPT)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 2,
        "total_tokens": len(ids) + 2,
    }


def test_echo_max_tokens_zero_returns_the_prompt_only(tokenizer):
    body, calls = answer(
        tokenizer, {"model": "a2", "prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 0}
    )
    assert calls[0].params.max_tokens == 0 and calls[0].params.prompt_logprobs == 0
    (choice,) = body["choices"]
    assert (choice["text"], choice["finish_reason"]) == (PROMPT, "length")
    ids = tokenizer(PROMPT).input_ids
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert choice["logprobs"]["top_logprobs"][1] == {choice["logprobs"]["tokens"][1]: -0.1}
    assert body["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize(
    "echo, logprobs, want", [(True, None, None), (False, 2, None), (True, 2, 2)]
)
def test_prompt_logprobs_are_asked_only_for_echo_with_logprobs(tokenizer, echo, logprobs, want):
    body, calls = answer(
        tokenizer, {"model": "a2", "prompt": PROMPT, "echo": echo, "logprobs": logprobs}
    )
    assert calls[0].params.prompt_logprobs == want
    assert body["choices"][0]["text"] == (PROMPT if echo else "") + "xy"


def test_a_token_id_prompt_echoes_its_decoded_text(tokenizer):
    ids = tokenizer(PROMPT).input_ids
    body, _ = answer(tokenizer, {"model": "a2", "prompt": ids, "echo": True})
    assert body["choices"][0]["text"] == tokenizer.decode(ids, skip_special_tokens=True) + "xy"


def test_a_stream_echoes_the_prompt_once_per_choice_in_its_first_chunk(tokenizer):
    chunks, _ = answer(
        tokenizer,
        {"model": "a2", "prompt": PROMPT, "echo": True, "logprobs": 0, "n": 2, "stream": True},
    )
    texts = {0: [], 1: []}
    for c in chunks:
        (choice,) = c["choices"]
        texts[choice["index"]].append(choice["text"])
    ids = tokenizer(PROMPT).input_ids
    for i in (0, 1):
        assert texts[i] == [PROMPT + "x", "y"]
    firsts = [
        c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["text"].startswith(PROMPT)
    ]
    assert [len(f["tokens"]) for f in firsts] == [len(ids) + 1] * 2
    assert all(f["token_logprobs"][0] is None for f in firsts)


@pytest.mark.parametrize(
    "prompt",
    [
        "hi<|endoftext|>there",  # a special token spelled in the text (a chat-formatted prompt)
        "<|user|>héllo<|end|> wörld",
        [76, 132],  # token ids ending in the first byte of a two-byte character
    ],
)
def test_echo_text_offsets_point_into_the_echoed_text(tokenizer, prompt):
    """Every prompt token whose text the echo shows starts at its offset, and the first
    generated token's offset is where the echoed prompt ends."""
    body, calls = answer(
        tokenizer, {"model": "a2", "prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 2}
    )
    (choice,) = body["choices"]
    lp, n = choice["logprobs"], len(calls[0].prompt_token_ids)
    echoed = choice["text"][: -len("xy")]
    assert lp["text_offset"][n] == len(echoed)
    for token, offset in zip(lp["tokens"][:n], lp["text_offset"][:n], strict=True):
        if not token.startswith("bytes:"):
            assert echoed.startswith(token, offset), (token, offset, echoed)


def test_a_batch_of_prompts_answers_prompt_i_choice_j_at_i_times_n_plus_j(tokenizer):
    """OpenAI's batched prompt (as lm-evaluation-harness sends it): each prompt gets n
    choices, echoes its own text, and usage counts each prompt once."""
    prompts = ["hello world", "the cat"]
    body, calls = answer(tokenizer, {"model": "a2", "prompt": prompts, "n": 2, "echo": True})
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [p + "xy" for p in prompts for _ in (0, 1)]
    assert [list(c.prompt_token_ids) for c in calls] == [
        tokenizer(p).input_ids for p in prompts for _ in (0, 1)
    ]
    lens = [len(tokenizer(p).input_ids) for p in prompts]
    assert body["usage"] == {
        "prompt_tokens": sum(lens),
        "completion_tokens": 8,
        "total_tokens": sum(lens) + 8,
    }
    chunks, _ = answer(
        tokenizer,
        {"model": "a2", "prompt": prompts, "echo": True, "stream": True,
         "stream_options": {"include_usage": True}},
    )  # fmt: skip
    texts: dict[int, str] = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "hello worldxy", 1: "the catxy"}
    assert chunks[-1]["usage"]["prompt_tokens"] == sum(lens)


def by_index(result, stream: bool) -> dict[int, dict]:
    """Each choice of a response (a stream's chunks joined): its text, logprobs and
    finish reason."""
    if not stream:
        return {
            c["index"]: {k: c[k] for k in ("text", "logprobs", "finish_reason")}
            for c in result["choices"]
        }
    got: dict[int, dict] = {}
    for chunk in result:
        for c in chunk["choices"]:
            whole = got.setdefault(c["index"], {"text": "", "logprobs": None})
            whole["text"] += c["text"]
            whole["finish_reason"] = c["finish_reason"]
            if c["logprobs"] is not None:
                lp = whole["logprobs"] or {k: [] for k in c["logprobs"]}
                whole["logprobs"] = {k: lp[k] + v for k, v in c["logprobs"].items()}
    return got


def by_prompt(ids, i: int) -> float:
    """Scores that differ between prompts (a choice echoing another prompt's would show)."""
    return -i / 10 - ids[i] / 1e4


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_tokens", [0, 2])
def test_n_choices_echo_the_scores_of_the_one_choice_that_has_them(tokenizer, stream, max_tokens):
    body = {"model": "a2", "prompt": PROMPT, "echo": True, "logprobs": 2, "stream": stream,
            "max_tokens": max_tokens}  # fmt: skip
    one, _ = answer(tokenizer, body)
    alone = by_index(one, stream)[0]
    assert alone["logprobs"]["token_logprobs"][1] == -0.1  # the scores are there
    for scorer in ("0", "2"):  # the replica scored choice 0's prompt, or choice 2's
        engine = EngineLike(scores_for=lambda call, i=scorer: call.request_id.endswith(f"-{i}"))
        many, calls = answer(tokenizer, {**body, "n": 3}, engine)
        assert [c.params.prompt_logprobs for c in calls] == [2, 2, 2]
        assert len({c.group for c in calls}) == 1
        assert by_index(many, stream) == {0: alone, 1: alone, 2: alone}


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_with_n_choices_echoes_each_prompt_its_own_scores(tokenizer, stream):
    """Each prompt's choices are a group of their own, scored once."""
    prompts = ["hello world", "the cat sat on a mat"]
    body = {"model": "a2", "echo": True, "logprobs": 1, "max_tokens": 2, "stream": stream}
    engine = EngineLike(by_prompt)
    many, calls = answer(tokenizer, {**body, "prompt": prompts, "n": 2}, engine)
    assert len({c.group for c in calls}) == 2 and engine.scored_groups == {c.group for c in calls}
    got = by_index(many, stream)
    for i, prompt in enumerate(prompts):
        one, _ = answer(tokenizer, {**body, "prompt": prompt}, EngineLike(by_prompt))
        alone = by_index(one, stream)[0]
        assert got[2 * i] == got[2 * i + 1] == alone


def test_a_choice_restarted_on_another_replica_still_echoes_the_scores(tokenizer):
    """Choice 1's replica dies after its first output: the choice starts again and still
    echoes choice 0's scores (its own replica computed none for it)."""
    body = {"model": "a2", "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 2}
    one, _ = answer(tokenizer, body)
    many, calls = answer(tokenizer, {**body, "n": 2}, EngineLike(fail={2}))
    assert len(calls) == 3 and calls[2].group == calls[0].group
    alone = by_index(one, False)[0]
    assert by_index(many, False) == {0: alone, 1: alone}
