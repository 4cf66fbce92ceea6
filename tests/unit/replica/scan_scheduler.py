"""The scheduler's waiting side as it was before `WaitingQueue`: one deque scanned from
its head every step. The tests compare the scheduler against it on random workloads
(same admissions, order, failures, preemptions); benchmarks/scheduler_cpu.py times it."""

from __future__ import annotations

import itertools
from collections import deque

from lora_core.errors import LoraFleetError
from replica.scheduler import Scheduler, SchedulerOutput
from replica.sequence import Sequence, Status


class ScanScheduler(Scheduler):
    """Scheduler with the old O(queue) waiting scan (no AdapterDemand): every method that
    touches the waiting queue is the old one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        assert self.demand is None, "the old scheduler reported no demand"
        self.waiting: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def active_adapters(self) -> int:
        seqs = itertools.chain(self.running, self.waiting)
        return len({seq.adapter_key for seq in seqs if seq.adapter is not None})

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            try:
                if self._needs_slot(seq) and not self.adapters.can_admit(seq.adapter):
                    skipped.append(self.waiting.popleft())
                    continue
                n = self._admit(seq, budget, out)
            except LoraFleetError as e:  # this request's adapter is gone: fail it alone
                self.waiting.popleft()
                self._fail(seq, e, out)
                continue
            if n is None:
                break
            self.waiting.popleft()
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._release(seq, keep_slot=True)
        seq.parked = False
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
