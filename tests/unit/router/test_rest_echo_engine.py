"""Completions with echo, logprobs and `n` choices over a real CPU engine (the REST handler,
a Frontend and an AsyncEngine, called as the replica deployment calls it; no Ray): every
choice answers as the same request with n = 1 does, and the engine computes the prompt
once. The first choice queued scores it; the others take its blocks from the prefix cache
(parked while it computes them) and compute only the last block, as
`engine.computed_tokens` counts."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest

from router import rest
from router.body_parse import parse_body
from router.frontend import Frontend
from router.openai_protocol import CompletionRequest
from tests.unit.replica.engines import small_engine
from tests.unit.router.served_engine import served_frontend
from tests.unit.router.test_frontend_auth import BASE
from tests.unit.router.test_rest_echo import by_index

_words = itertools.count()


def fresh_prompt() -> str:
    """A 30-word prompt no earlier request sent (its blocks are in no cache yet)."""
    return " ".join(f"w{next(_words)}" for _ in range(30))


@pytest.fixture(scope="module")
def served(llama_dir):
    engine = small_engine(llama_dir)  # 4-token blocks, prefix caching on
    with served_frontend(engine, 512) as front:
        yield front, engine


def complete(front: Frontend, body: dict):
    async def go():
        response = await rest.completions(front, None, parse_body(CompletionRequest, body))
        if not body.get("stream"):
            return json.loads(response.body)
        raw = b"".join([c async for c in response.body_iterator]).decode()
        datas = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
        assert datas[-1] == "[DONE]"
        return [json.loads(d) for d in datas[:-1]]

    return by_index(asyncio.run(go()), body.get("stream", False))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_tokens", [0, 3])
def test_n_echo_choices_compute_the_prompt_once_and_answer_as_one(served, stream, max_tokens):
    front, engine = served
    prompt = fresh_prompt()
    body = {"model": BASE, "prompt": prompt, "echo": True, "logprobs": 2, "n": 3,
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}  # fmt: skip
    before = engine.computed_tokens
    many = complete(front, body)
    computed = engine.computed_tokens - before
    one = complete(front, {**body, "n": 1})[0]
    p, bs = len(engine.tokenizer(prompt).input_ids), engine.config.block_size
    taken = (p - 1) // bs * bs  # every full block but one that holds the last token
    # one choice the whole prompt, each other the tokens after `taken`, then a token per
    # choice per decode step (before: 3 * p + decode)
    assert computed == p + 2 * (p - taken) + 3 * max(0, max_tokens - 1)
    assert set(many) == {0, 1, 2}
    for choice in many.values():
        assert choice["text"] == one["text"] and choice["finish_reason"] == one["finish_reason"]
        lp, want = choice["logprobs"], one["logprobs"]
        assert lp["tokens"] == want["tokens"] and lp["text_offset"] == want["text_offset"]
        # the echoed prompt's scores are the scoring choice's, computed as n = 1 does;
        # generated tokens' logprobs are the same model's, from cached KV for the others
        assert lp["token_logprobs"][:p] == want["token_logprobs"][:p]
        assert lp["top_logprobs"][:p] == want["top_logprobs"][:p]
        assert lp["token_logprobs"][p:] == pytest.approx(want["token_logprobs"][p:], abs=1e-5)
        assert len(lp["tokens"]) == p + max_tokens


def test_a_batch_with_n_choices_computes_each_prompt_once(served):
    front, engine = served
    prompts = [fresh_prompt(), fresh_prompt()[:50]]
    body = {"model": BASE, "prompt": prompts, "echo": True, "logprobs": 1, "n": 2,
            "max_tokens": 0}  # fmt: skip
    before = engine.computed_tokens
    many = complete(front, body)
    computed = engine.computed_tokens - before
    bs = engine.config.block_size
    lens = [len(engine.tokenizer(p).input_ids) for p in prompts]
    assert computed == sum(p + (p - (p - 1) // bs * bs) for p in lens)
    for i, prompt in enumerate(prompts):
        one = complete(front, {**body, "prompt": prompt, "n": 1})[0]
        assert many[2 * i] == many[2 * i + 1] == one
