"""The `n` choices of one request (one `group`) asking for prompt logprobs: the async front
computes them for the group's first arrival only. The others wait until it is queued,
even when it reaches the engine lock after them (requests are queued from worker
threads), and are queued without prompt logprobs, so they take its prompt blocks instead
of computing the prompt again (prefix-cache blocks carry no logits). When the first is
refused or has ended, later arrivals score for themselves; requests without a group, or
without prompt logprobs, neither wait nor change."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from lora_core.errors import InvalidRequest
from replica.async_engine import AsyncEngine
from replica.config import EngineConfig
from replica.sampling_params import SamplingParams

SCORED = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
IDS = list(range(5, 35))  # 7 full blocks of 4 and 2 tokens


@pytest.fixture
def engine(llama_dir):
    engine = AsyncEngine(EngineConfig(model=str(llama_dir), device="cpu", block_size=4))
    yield engine
    engine.shutdown()


def record_queueing(
    engine: AsyncEngine, slow: str = "", gate: threading.Event | None = None
) -> list[tuple[str, int | None]]:
    """(request id, its prompt_logprobs) in the order the engine queued them; request
    `slow` reaches the engine lock late (as one whose adapter loads from disk): 0.3 s late,
    or, given `gate`, once it is set (each request queued sets it), so that a stalled
    machine cannot let it in before the requests that are to overtake it."""
    queued: list[tuple[str, int | None]] = []
    add, add_request = engine._add, engine.engine.add_request

    def slow_add(request_id, *args):
        if request_id == slow and gate is None:
            time.sleep(0.3)
        elif request_id == slow:
            assert gate.wait(timeout=30), f"{slow} was never let in"
        add(request_id, *args)

    def add_and_record(request_id, ids, params, *args, **kwargs):
        add_request(request_id, ids, params, *args, **kwargs)
        queued.append((request_id, params.prompt_logprobs))
        if gate is not None:
            gate.set()

    engine._add = slow_add
    engine.engine.add_request = add_and_record
    return queued


async def outcome(engine: AsyncEngine, rid: str, group, ids=IDS, params=SCORED):
    """(generated ids, the prompt logprobs it got) or the error that refused it."""
    tokens, scores = [], None
    try:
        async for o in engine.generate(rid, ids, params, group=group):
            tokens += o.new_token_ids
            scores = scores or o.prompt_logprobs
    except InvalidRequest as e:
        return e
    return tokens, scores


def test_a_group_scores_its_prompt_once_for_its_first_arrival(engine):
    queued = record_queueing(engine, slow="a")
    before = engine.engine.computed_tokens

    async def run():
        return await asyncio.gather(*(outcome(engine, rid, "g") for rid in "abc"))

    (a, a_scores), (b, b_scores), (c, c_scores) = asyncio.run(run())
    assert queued == [("a", 1), ("b", None), ("c", None)] or queued == [
        ("a", 1), ("c", None), ("b", None),
    ]  # fmt: skip
    assert len(a_scores) == len(IDS) - 1 and b_scores is c_scores is None
    assert a == b == c and len(a) == 2
    # the prompt once, 2 tokens each for b and c, one decode step each
    assert engine.engine.computed_tokens - before == len(IDS) + 2 * 2 + 3
    assert engine._scorers == {}


def test_without_a_group_each_scores_and_a_slow_one_is_overtaken(engine):
    queued = record_queueing(engine, slow="a", gate=threading.Event())

    async def run():
        return await asyncio.gather(*(outcome(engine, rid, None) for rid in "ab"))

    (a, a_scores), (b, b_scores) = asyncio.run(run())
    assert queued == [("b", 1), ("a", 1)] and a_scores == b_scores and a == b


def test_a_group_without_prompt_logprobs_does_not_wait(engine):
    queued = record_queueing(engine, slow="a", gate=threading.Event())
    plain = SamplingParams(max_tokens=2, temperature=0.0)

    async def run():
        return await asyncio.gather(*(outcome(engine, r, "g", params=plain) for r in "ab"))

    asyncio.run(run())
    assert queued == [("b", None), ("a", None)] and engine._scorers == {}


def test_after_a_refused_first_arrival_the_others_score_for_themselves(engine):
    queued = record_queueing(engine, slow="a")

    async def run():
        bad = [5, 10**9]  # a token id outside the vocabulary
        return await asyncio.gather(
            outcome(engine, "a", "g", bad), outcome(engine, "b", "g"), outcome(engine, "c", "g")
        )

    refused, (_, b_scores), (_, c_scores) = asyncio.run(run())
    assert isinstance(refused, InvalidRequest)
    assert sorted(queued) == [("b", 1), ("c", 1)] and b_scores == c_scores
    assert engine._scorers == {}


def test_an_arrival_after_the_first_ended_scores_for_itself(engine):
    async def run():
        first = await outcome(engine, "a", "g")
        return first, await outcome(engine, "b", "g")

    (_, a_scores), (_, b_scores) = asyncio.run(run())
    assert a_scores == b_scores and len(a_scores) == len(IDS) - 1


def test_a_request_leaving_while_it_waits_for_the_first_leaves_the_rest_alone(engine):
    gate = threading.Event()
    queued = record_queueing(engine, slow="a", gate=gate)

    async def run():
        a = asyncio.ensure_future(outcome(engine, "a", "g"))
        b = asyncio.ensure_future(outcome(engine, "b", "g"))
        c = asyncio.ensure_future(outcome(engine, "c", "g"))
        await asyncio.sleep(0.05)
        b.cancel()
        gate.set()  # a reaches the lock only after b left
        return await asyncio.gather(a, b, c, return_exceptions=True)

    a, b, c = asyncio.run(run())
    assert isinstance(b, asyncio.CancelledError) and a[0] == c[0] and c[1] is None
    assert queued == [("a", 1), ("c", None)] and engine._scorers == {}
    assert engine.engine.scheduler.waiting.first() is None
