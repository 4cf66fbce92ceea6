"""A prompt block shared by requests that arrive together is computed once: the later
ones park until it is published (pure scheduler state, no model)."""

import random

from replica.block_manager import BlockManager
from replica.sampling_params import SamplingParams
from replica.scheduler import Scheduler
from replica.sequence import Sequence, Status
from tests.unit.replica.test_scheduler import FakeSlots, _ref


def _sched(blocks=64, bs=4, budget=100, caching=True, seqs=16):
    return Scheduler(BlockManager(blocks, bs, caching), FakeSlots(4), seqs, budget)


def _seq(i, prompt, adapter=None, max_tokens=4):
    return Sequence(
        str(i), len(prompt), list(prompt), SamplingParams(max_tokens=max_tokens), adapter, i
    )


def _step(s, out):
    """What the engine does after the model ran: publish, then sample where due."""
    s.after_step(out)
    for seq, _ in out.scheduled:
        if seq.status is Status.RUNNING and seq.remaining == 0:
            seq.tokens.append(7)
            if seq.num_output >= seq.params.max_tokens:
                s.finish(seq, "length")


def _plan(out):
    return [(q.request_id, n) for q, n in out.scheduled]


def _assert_idle(s):
    assert not s.has_work() and s._computing == {}
    assert s.blocks.num_free == s.blocks.num_blocks


def test_choices_of_one_prompt_compute_it_once():
    s = _sched()
    prompt = list(range(13))  # 3 full blocks and one token
    seqs = [_seq(i, prompt) for i in range(4)]
    for q in seqs:
        s.add(q)
    out = s.schedule()
    assert _plan(out) == [("0", 13)]  # the others park: running, computing nothing
    assert [q.status for q in seqs] == [Status.RUNNING] * 4 and s.num_parked == 3
    _step(s, out)
    out = s.schedule()
    assert _plan(out) == [("0", 1), ("1", 1), ("2", 1), ("3", 1)]  # each takes 3 blocks
    assert s.blocks.prefix_hit_tokens == 3 * 12
    assert all(q.block_table[:3] == seqs[0].block_table[:3] for q in seqs)
    while s.has_work():
        _step(s, s.schedule())
    _assert_idle(s)


def test_a_follower_waits_through_a_chunked_prefill():
    s = _sched(budget=8)
    prompt = list(range(21))  # 5 full blocks and one token
    owner, follower = _seq(0, prompt), _seq(1, prompt + [99])
    s.add(owner)
    s.add(follower)
    plans = []
    for _ in range(4):
        out = s.schedule()
        plans.append(_plan(out))
        _step(s, out)
    # The follower parks while the owner computes blocks 0-4, then computes its 2 tokens.
    assert plans == [[("0", 8)], [("0", 8)], [("0", 5)], [("0", 1), ("1", 2)]]
    assert follower.num_cached == 5 and follower.block_table[:5] == owner.block_table[:5]


def test_a_follower_computes_itself_once_its_owner_is_gone():
    s = _sched(budget=8)
    prompt = list(range(21))
    owner, follower = _seq(0, prompt), _seq(1, prompt)
    s.add(owner)
    s.add(follower)
    _step(s, s.schedule())  # the owner computed and published blocks 0-1
    s.finish(owner, "abort")  # withdraws blocks 2-5
    assert s._computing == {}
    out = s.schedule()
    assert _plan(out) == [("1", 8)] and follower.num_cached == 2 and not follower.parked
    while s.has_work():
        _step(s, s.schedule())
    _assert_idle(s)


def test_a_parked_follower_is_preempted_first_and_comes_back():
    s = _sched(blocks=9, budget=100)
    hog = _seq(0, list(range(100, 120)), max_tokens=8)  # 5 blocks, 6 once it decodes
    s.add(hog)
    _step(s, s.schedule())
    owner, follower = _seq(1, list(range(9))), _seq(2, list(range(9)))
    s.add(owner)
    s.add(follower)
    out = s.schedule()
    assert _plan(out) == [("0", 1), ("1", 9)] and follower.parked and s.blocks.num_free == 0
    _step(s, out)
    out = s.schedule()  # the follower takes blocks 0-1, needs a third: none is free
    assert _plan(out) == [("0", 1), ("1", 1)] and out.preempted == [follower]
    assert follower.block_table == [] and not follower.parked
    assert [s.blocks.ref_count(b) for b in owner.block_table[:2]] == [1, 1]
    while s.has_work():
        _step(s, s.schedule())
    _assert_idle(s)
    assert owner.finish_reason == follower.finish_reason == hog.finish_reason == "length"


def test_other_adapters_and_a_cache_that_is_off_never_park():
    prompt = list(range(13))
    s = _sched()
    s.add(_seq(0, prompt, _ref("a")))
    s.add(_seq(1, prompt, _ref("b")))  # the same tokens under another adapter: other KV
    s.add(_seq(2, prompt))
    assert _plan(s.schedule()) == [("0", 13), ("1", 13), ("2", 13)]
    s = _sched(caching=False)
    s.add(_seq(0, prompt))
    s.add(_seq(1, prompt))
    out = s.schedule()
    assert _plan(out) == [("0", 13), ("1", 13)] and s.num_parked == 0
    while s.has_work():
        _step(s, s.schedule())
    _assert_idle(s)


def test_a_shared_first_block_then_different_prompts():
    s = _sched()
    s.add(_seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    s.add(_seq(1, [1, 2, 3, 4, 9, 9, 9, 9, 9, 9]))
    out = s.schedule()
    assert _plan(out) == [("0", 9)]
    _step(s, out)
    assert _plan(s.schedule()) == [("0", 1), ("1", 6)]  # took block 0, computes the rest


def test_a_request_waiting_for_kv_counts_no_prefix_hits():
    s = _sched(blocks=6)
    first = _seq(0, list(range(9)), max_tokens=1)
    s.add(first)
    _step(s, s.schedule())  # published blocks 0-1 of range(8), then finished
    hog = _seq(1, list(range(100, 113)), max_tokens=20)  # 4 blocks, 3 tokens of room
    s.add(hog)
    _step(s, s.schedule())
    late = _seq(2, list(range(8)) + list(range(50, 60)))  # takes 2 cached, needs 3 more
    s.add(late)
    for _ in range(2):
        _step(s, s.schedule())
        assert late.status is Status.WAITING and late.block_table == []
        assert s.blocks.prefix_hit_tokens == 0  # was 8 more per step it waited
    s.finish(hog, "abort")
    _step(s, s.schedule())
    assert late.status is Status.RUNNING and s.blocks.prefix_hit_tokens == 8


def _checked_step(s, seed):
    out = s.schedule()
    for q in s.running:
        # a parked sequence waits on a block being computed, or already published (but
        # the step's budget ran out before the parked sequence's turn to take it)
        h = q.hashes[len(q.block_table)] if q.parked else None
        assert not q.parked or h in s._computing or h in s.blocks._cached, f"seed {seed}"
    _step(s, out)


def test_random_workload_finishes_with_nothing_left_announced():
    """Shared system prompts, chunked prefill, tight KV (preemption), aborts: every
    request finishes, a parked sequence only ever waits on an announced block, and
    nothing stays announced or allocated."""
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    s = _sched(blocks=12, bs=4, budget=12, seqs=6)
    systems = [[rng.randrange(50) for _ in range(rng.randrange(5, 18))] for _ in range(3)]
    adapters = [None, _ref("a"), _ref("b")]
    live: list[Sequence] = []
    for _ in range(40):  # bursts of requests that arrive together
        system, adapter = rng.choice(systems), rng.choice(adapters)
        for _ in range(rng.randrange(1, 5)):
            prompt = system + [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
            live.append(_seq(len(live), prompt, adapter, max_tokens=rng.randrange(1, 10)))
            s.add(live[-1])
        if rng.random() < 0.2:
            s.finish(rng.choice(live), "abort")
        _checked_step(s, seed)
    for _ in range(2000):
        if not s.has_work():
            break
        _checked_step(s, seed)
    _assert_idle(s)
    assert all(q.status is Status.FINISHED for q in live), f"seed {seed}"
    assert s.num_parked > 0 and s.num_preemptions > 0, f"seed {seed}: not exercised"
