"""Scheduler behaviour on pure state (no model): budgets, chunking, admission, preemption."""

from lora_core.identity import AdapterRef
from replica.block_manager import BlockManager
from replica.sampling_params import SamplingParams
from replica.scheduler import Scheduler
from replica.sequence import Sequence, Status


class FakeSlots:
    """Two slots; an adapter is admissible if it holds a slot or one is free."""

    def __init__(self, slots: int = 2):
        self.slots = slots
        self.users: dict[str, int] = {}

    def can_admit(self, ref):
        return ref.key in self.users or len(self.users) < self.slots

    def acquire(self, ref):
        self.users[ref.key] = self.users.get(ref.key, 0) + 1
        return list(self.users).index(ref.key)

    def release(self, ref):
        self.users[ref.key] -= 1
        if not self.users[ref.key]:
            del self.users[ref.key]


def _ref(name):
    return AdapterRef(name, 1, name * 8, "/x", 8)


def _seq(i, n_prompt, adapter=None):
    return Sequence(
        str(i), n_prompt, list(range(n_prompt)), SamplingParams(max_tokens=8), adapter, i
    )


def _sched(blocks=32, bs=4, seqs=8, budget=16, slots=2):
    return Scheduler(BlockManager(blocks, bs, False), FakeSlots(slots), seqs, budget)


def _finish_step(s, out):
    s.after_step(out)
    for seq, _ in out.scheduled:
        if seq.remaining == 0:
            seq.tokens.append(1)


def test_chunked_prefill_respects_token_budget():
    s = _sched(budget=16)
    s.add(_seq(0, 40))
    chunks = []
    for _ in range(3):
        out = s.schedule()
        chunks.append([n for _, n in out.scheduled])
        _finish_step(s, out)
    assert chunks == [[16], [16], [8]]


def test_decode_before_new_prefill_and_budget_shared():
    s = _sched(budget=10)
    s.add(_seq(0, 4))
    _finish_step(s, s.schedule())
    s.add(_seq(1, 30))
    out = s.schedule()
    assert [(q.request_id, n) for q, n in out.scheduled] == [("0", 1), ("1", 9)]


def test_max_num_seqs():
    s = _sched(seqs=2, budget=100)
    for i in range(3):
        s.add(_seq(i, 4))
    out = s.schedule()
    assert [q.request_id for q, _ in out.scheduled] == ["0", "1"]
    assert [q.request_id for q in s.waiting] == ["2"]


def test_adapter_that_cannot_get_a_slot_is_skipped_not_blocking():
    s = _sched(slots=2, budget=100)
    a, b, c = _ref("a"), _ref("b"), _ref("c")
    s.add(_seq(0, 4, a))
    s.add(_seq(1, 4, b))
    s.add(_seq(2, 4, c))  # no slot left for c
    s.add(_seq(3, 4, None))  # base request goes ahead
    s.add(_seq(4, 4, a))  # shares a's slot
    out = s.schedule()
    assert [q.request_id for q, _ in out.scheduled] == ["0", "1", "3", "4"]
    assert [q.request_id for q in s.waiting] == ["2"]
    # Once b's request finishes, c is admitted.
    s.finish(out.scheduled[1][0], "stop")
    _finish_step(s, out)
    assert "2" in [q.request_id for q, _ in s.schedule().scheduled]


def test_preemption_by_recompute_when_blocks_run_out():
    s = _sched(blocks=4, bs=4, budget=100)
    s.add(_seq(0, 8))
    s.add(_seq(1, 8))
    out = s.schedule()
    _finish_step(s, out)  # both hold 2 blocks, both now need a third
    out = s.schedule()
    assert [q.request_id for q in out.preempted] == ["1"]
    assert [(q.request_id, n) for q, n in out.scheduled] == [("0", 1)]
    victim = out.preempted[0]
    assert victim.status is Status.WAITING and victim.num_computed == 0 and victim.block_table == []
    assert victim.tokens[-1] == 1  # generated tokens are kept and recomputed
    assert s.num_preemptions == 1


def test_finish_releases_blocks_and_slot():
    slots = FakeSlots()
    s = Scheduler(BlockManager(8, 4, False), slots, 8, 100)
    seq = _seq(0, 6, _ref("a"))
    s.add(seq)
    s.schedule()
    assert slots.users and s.blocks.num_free == 6
    s.finish(seq, "abort")
    assert not slots.users and s.blocks.num_free == 8 and seq.finish_reason == "abort"


def test_active_adapters_counts_distinct_adapters_running_and_waiting():
    s = _sched(slots=1)
    a, b = _ref("a"), _ref("b")
    for i, ref in enumerate([a, a, b, None, b]):
        s.add(_seq(i, 4, ref))
    assert s.active_adapters() == 2  # all waiting: a, b (base requests need no slot)
    out = s.schedule()
    assert {seq.adapter_key for seq, _ in out.scheduled} == {a.key, ""}  # b waits for the slot
    assert s.active_adapters() == 2
    for seq, _ in out.scheduled:
        s.finish(seq, "stop")
    assert s.active_adapters() == 1  # a's requests are done; b's still wait


def test_preempted_sequence_keeps_its_slot_until_it_finishes():
    """Preemption frees KV only: the victim's adapter stays acquired (an unload must not
    purge it under a request that already streamed tokens), it is re-admitted without
    asking for a slot again, and finishing releases the slot once."""

    class Counting(FakeSlots):
        def __init__(self):
            super().__init__(1)
            self.calls: list[str] = []

        def can_admit(self, ref):
            self.calls.append("can_admit")
            return super().can_admit(ref)

        def acquire(self, ref):
            self.calls.append("acquire")
            return super().acquire(ref)

    slots = Counting()
    s = Scheduler(BlockManager(4, 4, False), slots, 8, 100)
    s.add(_seq(0, 8))
    s.add(_seq(1, 8, _ref("a")))
    _finish_step(s, s.schedule())
    out = s.schedule()
    (victim,) = out.preempted
    assert victim.request_id == "1" and victim.holds_slot and slots.users == {_ref("a").key: 1}
    slots.calls.clear()
    base = next(seq for seq, _ in out.scheduled)
    s.finish(base, "stop")  # its blocks come back: the victim is re-admitted
    out = s.schedule()
    assert [q.request_id for q, _ in out.scheduled] == ["1"] and slots.calls == []
    s.finish(victim, "stop")
    assert slots.users == {}
