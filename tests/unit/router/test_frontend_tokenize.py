"""Frontend tokenization: off the event loop, and text that cannot fit refused before it.

A 10 MB prompt used to be tokenized on the ingress's event loop: every other request
(even GET /v1/models) waited the ~10 s it took, only for the prompt to be refused as too
long afterwards.
"""

import asyncio
import time

import pytest

from lora_core.errors import InvalidRequest
from tests.unit.router.test_frontend_auth import Dispatcher, make_front, tokenizer

__all__ = ["tokenizer"]  # the module fixture, shared

LONGEST = len("<|endoftext|>")  # the demo tokenizer's longest token


async def _worst_tick_gap(work) -> tuple[float, object]:
    """Runs `work` while a ticker sleeps 20 ms at a time on the same loop; returns the
    longest the ticker waited for the loop, and work's result."""
    done, worst = False, 0.0

    async def ticker():
        nonlocal worst
        last = time.monotonic()
        while not done:
            await asyncio.sleep(0.02)
            now = time.monotonic()
            worst, last = max(worst, now - last), now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    try:
        result = await work
    finally:
        done = True
        await tick
    return worst, result


def test_a_long_prompt_is_tokenized_without_stalling_the_loop(tokenizer):
    prompt = "a " * 2_000_000  # ~3 s of tokenizing on one core
    front = make_front(tokenizer, Dispatcher(), max_len=len(prompt))
    started = time.monotonic()
    worst, ids = asyncio.run(_worst_tick_gap(front.encode_prompt(prompt)))
    took = time.monotonic() - started
    assert ids == tuple(tokenizer(prompt).input_ids)
    assert took > 1.0  # the work is long enough for a stall to show
    # on the loop it stalls for all of `took`; off it, for a share of a loaded machine, or
    # for a stall of the whole machine, which lengthens `took` as much
    assert worst < max(0.5, took / 2), f"the event loop stalled {worst:.2f} s of {took:.2f} s"


def test_a_long_chat_is_rendered_without_stalling_the_loop(tokenizer):
    messages = [{"role": "user", "content": "a " * 2_000_000}]
    front = make_front(tokenizer, Dispatcher(), max_len=5_000_000)
    started = time.monotonic()
    worst, ids = asyncio.run(_worst_tick_gap(front.encode_chat(messages)))
    took = time.monotonic() - started
    expected = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == tuple(expected)
    assert worst < max(0.5, took / 2), f"the event loop stalled {worst:.2f} s of {took:.2f} s"


def test_concurrent_prompts_each_get_their_own_tokens(tokenizer):
    front = make_front(tokenizer, Dispatcher())
    prompts = [f"prompt number {i} " * (i % 7 + 1) for i in range(64)]

    async def all_of_them():
        return await asyncio.gather(*(front.encode_prompt(p) for p in prompts))

    assert asyncio.run(all_of_them()) == [tuple(tokenizer(p).input_ids) for p in prompts]


def test_text_that_no_tokenization_can_fit_is_refused_before_tokenizing(tokenizer):
    front = make_front(tokenizer, Dispatcher(), max_len=64)
    limit = 64 * LONGEST
    assert front.longest_token == LONGEST
    with pytest.raises(InvalidRequest) as e:
        asyncio.run(front.encode_prompt("a" * (limit + 1)))
    assert e.value.param == "prompt"
    assert str(e.value) == (
        f"prompt: {limit + 1} characters cannot fit the model's context of 64 tokens (no "
        f"token spells more than {LONGEST} characters, so at most {limit}); allowed: a "
        "prompt of at most 63 tokens"
    )
    # At the limit the prompt is tokenized (and its length is judged in tokens later).
    assert asyncio.run(front.encode_prompt("a" * limit)) == tuple(tokenizer("a" * limit).input_ids)


def test_chat_text_that_cannot_fit_is_refused_naming_messages(tokenizer):
    front = make_front(tokenizer, Dispatcher(), max_len=64)
    half = 64 * LONGEST // 2 + 1  # two messages, together one character over
    messages = [
        {"role": "user", "content": "b" * half},
        {"role": "assistant", "content": "c" * half},
    ]
    with pytest.raises(InvalidRequest) as e:
        asyncio.run(front.encode_chat(messages))
    assert e.value.param == "messages"
    assert str(e.value).startswith(f"messages: {2 * half} characters cannot fit")
