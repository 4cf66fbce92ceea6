"""The per-adapter waiting queue: a blocked adapter costs one look per step however many of
its requests wait; the scheduler admits, skips, fails and preempts exactly as the old
full scan did (random workloads, compared step by step); queued demand stays balanced."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from lora_core.errors import AdapterNotFound, CapacityExceeded
from lora_core.identity import AdapterRef
from replica.block_manager import BlockManager
from replica.sampling_params import SamplingParams
from replica.scheduler import Scheduler
from replica.sequence import Sequence, Status
from replica.waiting_queue import WaitingQueue
from tests.unit.replica.scan_scheduler import ScanScheduler


class Slots:
    """n refcounted slots; adapters in `gone` raise AdapterNotFound (unloaded); counts
    can_admit calls (looks) and the demand (want / unwant) per key."""

    def __init__(self, n: int):
        self.n = n
        self.users: dict[str, int] = {}
        self.gone: set[str] = set()
        self.looks: Counter[str] = Counter()
        self.wanted: Counter[str] = Counter()

    def can_admit(self, ref: AdapterRef) -> bool:
        self.looks[ref.key] += 1
        return self._room(ref)

    def _room(self, ref: AdapterRef) -> bool:
        if ref.key in self.gone:
            raise AdapterNotFound(ref.name)
        return ref.key in self.users or len(self.users) < self.n

    def acquire(self, ref: AdapterRef) -> int:
        if not self._room(ref):
            raise CapacityExceeded("no slot")
        self.users[ref.key] = self.users.get(ref.key, 0) + 1
        return list(self.users).index(ref.key)

    def release(self, ref: AdapterRef) -> None:
        self.users[ref.key] -= 1
        if not self.users[ref.key]:
            del self.users[ref.key]

    def want(self, ref: AdapterRef) -> None:
        self.wanted[ref.key] += 1

    def unwant(self, ref: AdapterRef) -> None:
        assert self.wanted[ref.key] > 0, f"unwant({ref.key}) without want"
        self.wanted[ref.key] -= 1
        if not self.wanted[ref.key]:
            del self.wanted[ref.key]


REFS = [AdapterRef(n, 1, n * 8, "/x", 8) for n in "abcd"]


def _seq(rid: int, tokens: list[int], adapter: AdapterRef | None, max_tokens: int = 8):
    params = SamplingParams(max_tokens=max_tokens)
    return Sequence(str(rid), len(tokens), list(tokens), params, adapter, rid)


def _step(s: Scheduler) -> None:
    """One model step: computed counts advance, finished prompts sample a token."""
    out = s.schedule()
    s.after_step(out)
    for seq, _ in out.scheduled:
        if seq.remaining == 0:
            seq.tokens.append(1)


def test_queue_worked_example_from_docstring():
    a, b = REFS[:2]
    a1, b1, a2, p = _seq(0, [1], a), _seq(1, [1], b), _seq(2, [1], a), _seq(3, [1], b)
    q = WaitingQueue()
    for seq in (a1, b1, a2):
        q.append(seq)
    q.appendleft(p)
    assert list(q) == [p, a1, b1, a2] and len(q) == 4 and set(q.adapter_keys()) == {a.key, b.key}
    assert q.first() is p
    q.remove(p)  # admitted
    assert q.first() is a1
    q.pass_over()  # no slot for a
    assert q.first() is b1
    q.remove(b1)
    assert q.first() is None  # a2 is never looked at
    q.end_scan()
    assert q.first() is a1 and list(q) == [a1, a2] and b1 not in q and a2 in q


def test_queue_passes_a_group_over_once():
    """x is first of its group twice (before and after preempted p): passed over, the
    group stays out of the scan."""
    a = REFS[0]
    x, p = _seq(0, [1], a), _seq(1, [1], a)
    q = WaitingQueue()
    q.append(x)
    q.appendleft(p)
    q.remove(p)
    assert q.first() is x
    q.pass_over()
    assert q.first() is None
    q.end_scan()
    assert q.first() is x


def test_queue_drops_stale_heap_entries():
    """Removing group heads far behind the scan leaves stale heap entries; end_scan keeps
    their number within a bound of the groups'."""
    q = WaitingQueue()
    seqs = [_seq(i, [1], REFS[i % 4]) for i in range(2000)]
    for seq in seqs:
        q.append(seq)
    for seq in seqs[:1500]:  # aborted from the head of their groups, one by one
        q.remove(seq)
        q.end_scan()
        assert len(q._heap) <= 2 * 4 + 16
    assert list(q) == seqs[1500:]


def test_blocked_adapter_costs_one_look_per_step_however_many_wait():
    """1000 requests of adapter b wait for the only slot (held by a running request of a);
    a base request and one of a queued behind them are admitted, and the step looks at b
    once. The old scan asked for a slot 1000 times per step."""
    a, b = REFS[:2]
    for cls, looks in ((Scheduler, 1), (ScanScheduler, 1000)):
        slots = Slots(1)
        s = cls(BlockManager(4096, 4, False), slots, 8, 1000)
        s.add(_seq(0, [1, 2, 3], a, max_tokens=100))
        _step(s)
        for i in range(1, 1001):
            s.add(_seq(i, [1, 2, 3], b))
        s.add(_seq(1001, [1, 2], None))
        s.add(_seq(1002, [4, 5], a))
        slots.looks.clear()
        out = s.schedule()
        assert [q.request_id for q, _ in out.scheduled] == ["0", "1001", "1002"]
        assert slots.looks[b.key] == looks, cls.__name__
        assert len(s.waiting) == 1000 and s.active_adapters() == 2


def _mirror(seed: int):
    """The same random workload on the scheduler and on the old full-scan one."""
    rng = random.Random(seed)
    kv = dict(num_blocks=rng.randint(6, 16), block_size=4, enable_prefix_caching=True)
    limits = dict(max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(1, 24))
    slots = rng.randint(1, 3)
    new, old = Slots(slots), Slots(slots)
    return (
        rng,
        Scheduler(BlockManager(**kv), new, **limits, demand=new),
        ScanScheduler(BlockManager(**kv), old, **limits),
    )


def _view(s: Scheduler, out) -> tuple:
    return (
        [(q.request_id, n) for q, n in out.scheduled],
        [q.request_id for q in out.preempted],
        [(q.request_id, type(e).__name__) for q, e in out.failed],
        [q.request_id for q in s.waiting],
        [q.request_id for q in s.running],
        s.active_adapters(),
        s.num_preemptions,
    )


def _wanted_by_queue(s: Scheduler) -> Counter[str]:
    return Counter(q.adapter_key for q in s.waiting if q.adapter is not None and not q.holds_slot)


@pytest.mark.parametrize("seed", range(30))
def test_matches_the_old_full_scan_step_by_step(seed):
    """Arrivals, aborts, unloads (waiting requests of an unloaded adapter fail alone),
    KV shortage, preemption and prefix hits: both schedulers make the same decisions
    every step, and the demand reported equals the queued requests without a slot."""
    rng, new, old = _mirror(seed)
    seqs: dict[str, tuple[Sequence, Sequence]] = {}
    max_len = new.blocks.num_blocks * 4
    for rid in range(300):
        if rng.random() < 0.5:
            adapter = rng.choice([*REFS, None])
            tokens = [rng.randrange(3) for _ in range(rng.randint(1, 12))]
            max_tokens = rng.randint(1, min(12, max_len - len(tokens)))
            pair = tuple(_seq(rid, tokens, adapter, max_tokens) for _ in "no")
            seqs[str(rid)] = pair
            new.add(pair[0])
            old.add(pair[1])
        if rng.random() < 0.02:  # unloaded, or registered again
            gone = rng.choice(REFS).key
            for slots in (new.adapters, old.adapters):
                slots.gone ^= {gone}
        live = sorted(r for r, (q, _) in seqs.items() if q.status is not Status.FINISHED)
        if live and rng.random() < 0.1:
            victim = rng.choice(live)
            for s, q in zip((new, old), seqs[victim], strict=True):
                s.finish(q, "abort")
        outs = new.schedule(), old.schedule()
        assert _view(new, outs[0]) == _view(old, outs[1])
        assert new.adapters.looks.total() <= old.adapters.looks.total()
        for s, out in zip((new, old), outs, strict=True):
            s.after_step(out)
            for q, _ in out.scheduled:
                if q.remaining == 0:
                    q.tokens.append((int(q.request_id) + len(q.tokens)) % 3)
                    if q.num_output >= q.params.max_tokens:
                        s.finish(q, "length")
        assert new.adapters.wanted == _wanted_by_queue(new)
    while new.has_work():
        for s in (new, old):
            for q in list(s.waiting) + list(s.running):
                s.finish(q, "abort")
    assert not old.has_work() and not new.adapters.wanted and not new.adapters.users


def test_a_held_want_is_taken_over_not_doubled():
    """add(seq, want_held=True): the caller's want becomes the queue's (one count, lowered
    once at admission); refused for a base request or a scheduler without a demand."""
    a = REFS[0]
    slots = Slots(1)
    s = Scheduler(BlockManager(16, 4, False), slots, 4, 64, demand=slots)
    slots.want(a)
    s.add(_seq(0, [1, 2, 3], a), want_held=True)
    assert slots.wanted == Counter({a.key: 1})
    _step(s)
    assert not slots.wanted and slots.users == {a.key: 1}
    with pytest.raises(ValueError, match="want_held: allowed only"):
        s.add(_seq(1, [1, 2], None), want_held=True)
    bare = Scheduler(BlockManager(16, 4, False), slots, 4, 64)
    with pytest.raises(ValueError, match="want_held: allowed only"):
        bare.add(_seq(2, [1, 2], a), want_held=True)
