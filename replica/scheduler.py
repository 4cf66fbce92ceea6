"""Continuous batching with chunked prefill, a token budget and preemption by recompute.

Each step: running sequences first (decode tokens or the next prefill chunk), then
waiting ones in arrival order while the step has budget, sequence room and KV
blocks. A waiting request whose adapter cannot be made slot-resident now (every
slot busy with running requests or pinned) is skipped, not blocking others, and so are
new requests of the adapter whose slot is yielding to it (`lora_core.pool`: otherwise
adapters with steady traffic keep every slot and it waits forever); one whose
adapter is gone (unloaded while it waited) fails alone (SchedulerOutput.failed); KV
shortage blocks admission in FIFO order. When a running sequence needs a block and
none is free, the latest-arrived running sequence is preempted: its blocks are
freed and it is recomputed from its tokens later. It keeps its adapter slot while
preempted: an unload lets in-flight requests finish, and a slot released here would
purge a draining adapter under a request that already streamed tokens (the request
would then fail as if it had never started). Preempted sequences wait at the head
of the queue, so the slot they hold delays no one admitted before them.

A step's waiting-side work is bounded by what it admits, fails and skips, not by the
queue's length: the queue is kept per adapter (`WaitingQueue`), so skipping an adapter
that cannot get a slot costs one look however many of its requests wait, and the scan
stops at the first KV shortage or when the budget or the sequence room runs out.

Queued requests that wait for an adapter slot are reported to `AdapterDemand` (when
given), so the CPU adapter cache keeps their adapters while it can drop others.

A prompt block is computed once even when several requests that share it arrive
together (the `n` choices of one request, a burst with one system prompt): a sequence
that starts computing announces the hashes of the full blocks it will publish, and a
sequence whose next block is not cached but announced is admitted *parked*: it holds
its seat, slot and cached blocks, computes nothing, and each step takes the blocks
published since, until its next block is neither cached nor being computed. Only
computing sequences announce and only parked ones wait, so no two wait on each other.
Example (block size 4): a 12-token prompt p is admitted and announces blocks 0-2; a
second request with prompt p + [9] admitted in the same step parks; after the step it
takes blocks 0-2 from the cache and computes token 9 alone (1 token, not 13).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from lora_core.errors import LoraFleetError
from lora_core.identity import AdapterRef
from replica.block_manager import BlockManager, block_hash
from replica.sequence import Sequence, Status
from replica.waiting_queue import WaitingQueue


class AdapterAdmission(Protocol):
    """What the scheduler needs from the adapter manager."""

    def can_admit(self, ref: AdapterRef) -> bool: ...

    def acquire(self, ref: AdapterRef) -> int: ...

    def release(self, ref: AdapterRef) -> None: ...


class AdapterDemand(Protocol):
    """Where the scheduler reports which adapters queued requests wait for: want(ref)
    once per request queued without a slot, unwant(ref) once when it gets its slot,
    fails or is aborted. A preempted sequence is not counted: it keeps its slot, so its
    adapter is in use and stays in memory anyway."""

    def want(self, ref: AdapterRef) -> None: ...

    def unwant(self, ref: AdapterRef) -> None: ...


@dataclass
class SchedulerOutput:
    """scheduled: (sequence, tokens to compute this step), decode-like (1 token) first.
    failed: waiting sequences finished with an error because their adapter cannot be
    served any more (unloaded while they waited, its files gone): only they fail."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, LoraFleetError]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        adapters: AdapterAdmission,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        demand: AdapterDemand | None = None,
    ):
        self.blocks = blocks
        self.adapters = adapters
        self.demand = demand
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max_num_batched_tokens
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_parked = 0  # admissions that waited for a block another sequence computed
        self._computing: dict[int, int] = {}  # announced block hash -> announcers

    def add(self, seq: Sequence, want_held: bool = False) -> None:
        """Queue seq. want_held: the caller already counted seq's want on `demand` (the
        async front does, from before it loads the adapter, so the CPU cache spares it
        in between); the queue takes that count over instead of raising another."""
        if want_held and (self.demand is None or not self._needs_slot(seq)):
            raise ValueError("want_held: allowed only for an adapter request with a demand")
        self.waiting.append(seq)
        if self.demand is not None and self._needs_slot(seq) and not want_held:
            self.demand.want(seq.adapter)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def active_adapters(self) -> int:
        """Distinct adapters among running and waiting sequences."""
        keys = {seq.adapter_key for seq in self.running}
        keys.update(self.waiting.adapter_keys())
        keys.discard("")  # base requests
        return len(keys)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_tokens)
        self._schedule_waiting(out, budget)
        out.scheduled.sort(key=lambda item: item[1] != 1)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        queue = list(self.running)
        while queue and budget > 0:
            seq = queue.pop(0)
            if seq.parked:
                if self._take_cached(seq):
                    continue  # its next block is still being computed by another
                seq.parked = False
                self._announce(seq)
            n = min(seq.remaining, budget)
            while not self._grow(seq, n):
                victim = queue.pop() if queue else seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, n))
                budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        try:
            while budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting.first()
                if seq is None:
                    break
                try:
                    if self._needs_slot(seq) and not self.adapters.can_admit(seq.adapter):
                        # Admissions only take slots, so none frees up later in this step:
                        # skip every request of this adapter at once (they all need one).
                        self.waiting.pass_over()
                        continue
                    n = self._admit(seq, budget, out)
                except LoraFleetError as e:  # this request's adapter is gone: fail it alone
                    self.waiting.remove(seq)
                    self._fail(seq, e, out)
                    continue
                if n is None:
                    break
                self.waiting.remove(seq)
                budget -= n
        finally:
            self.waiting.end_scan()

    def _fail(self, seq: Sequence, error: LoraFleetError, out: SchedulerOutput) -> None:
        self._unwant(seq)
        self._release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = "error"
        out.failed.append((seq, error))

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int | None:
        """Admit seq: the tokens it computes this step (0 when parked), None (and seq
        untouched) when KV blocks are too few."""
        parked = self._take_cached(seq)
        n = 0 if parked else min(seq.remaining, budget)
        if not self._grow(seq, n):
            self._unadmit(seq)
            return None
        if self._needs_slot(seq):
            try:
                seq.lora_slot = self.adapters.acquire(seq.adapter)
            except LoraFleetError:
                self._unadmit(seq)
                raise
            self._unwant(seq)
            seq.holds_slot = True
        seq.status = Status.RUNNING
        self.running.append(seq)
        if parked:
            seq.parked = True
            self.num_parked += 1
        else:
            self._announce(seq)
            out.scheduled.append((seq, n))
        return n

    def _unadmit(self, seq: Sequence) -> None:
        """Undo a failed admission. The cached blocks it took go back unused, so they are
        no prefix hits: a request waiting for KV would count its prefix again each step."""
        self.blocks.prefix_hit_tokens -= seq.num_cached * self.blocks.block_size
        self._free_blocks(seq)

    def _hash(self, seq: Sequence, i: int) -> int:
        """The prefix-cache hash of seq's full block i (each computed once per sequence)."""
        hashes, bs = seq.hashes, self.blocks.block_size
        while len(hashes) <= i:
            j = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(block_hash(parent, seq.prefix_key, seq.tokens[j * bs : (j + 1) * bs]))
        return hashes[i]

    def _take_cached(self, seq: Sequence) -> bool:
        """Extend seq's KV (all of it computed, none announced) with the cached blocks
        that continue it, leaving at least one token to compute so the step yields
        logits, and no position whose logits seq's prompt logprobs still need. True when
        the block after them is being computed by a running sequence: seq should wait for
        it rather than compute it a second time."""
        if not self.blocks.prefix_caching:
            return False
        bs = self.blocks.block_size
        i, last = len(seq.block_table), (len(seq.tokens) - 1) // bs
        scored = seq.scored_until
        if scored is not None:
            last = min(last, scored // bs)
        waits = False
        while i < last:
            h = self._hash(seq, i)
            block = self.blocks.take_cached(h)
            if block is None:
                waits = h in self._computing
                break
            seq.block_table.append(block)
            i += 1
        seq.num_cached, seq.num_computed = i, i * bs
        return waits

    def _announce(self, seq: Sequence) -> None:
        """seq starts computing: announce the hashes of the full blocks it will publish."""
        if not self.blocks.prefix_caching:
            return
        seq.announced = len(seq.tokens) // self.blocks.block_size
        for i in range(seq.num_cached, seq.announced):
            h = self._hash(seq, i)
            self._computing[h] = self._computing.get(h, 0) + 1

    def _withdraw(self, h: int) -> None:
        left = self._computing[h] - 1
        if left:
            self._computing[h] = left
        else:
            del self._computing[h]

    def _free_blocks(self, seq: Sequence) -> None:
        """Drop seq's KV and withdraw what it announced."""
        for i in range(seq.num_cached, seq.announced):
            self._withdraw(seq.hashes[i])
        self.blocks.free(seq.block_table)
        seq.block_table, seq.num_computed, seq.num_cached, seq.announced = [], 0, 0, 0

    @staticmethod
    def _needs_slot(seq: Sequence) -> bool:
        """seq has an adapter and no slot yet (a preempted sequence still holds its own)."""
        return seq.adapter is not None and not seq.holds_slot

    def _unwant(self, seq: Sequence) -> None:
        """A waiting seq without a slot got one, failed or was aborted: it stops waiting."""
        if self.demand is not None and self._needs_slot(seq):
            self.demand.unwant(seq.adapter)

    def _grow(self, seq: Sequence, n: int) -> bool:
        """Give seq blocks for num_computed + n tokens; False if too few are free."""
        need = self.blocks.blocks_needed(seq.num_computed + n, len(seq.block_table))
        if need > self.blocks.num_free:
            return False
        seq.block_table.extend(self.blocks.allocate(need))
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._release(seq, keep_slot=True)
        seq.parked = False
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def _release(self, seq: Sequence, keep_slot: bool = False) -> None:
        self._free_blocks(seq)
        if seq.holds_slot and not keep_slot:
            self.adapters.release(seq.adapter)
            seq.holds_slot, seq.lora_slot = False, -1

    def after_step(self, out: SchedulerOutput) -> None:
        """Advance computed counts and publish newly full blocks to the prefix cache."""
        bs, caching = self.blocks.block_size, self.blocks.prefix_caching
        for seq, n in out.scheduled:
            if seq.status is not Status.RUNNING:
                continue  # finished or aborted since it was scheduled
            seq.num_computed += n
            full = seq.num_computed // bs
            while caching and seq.num_cached < full:
                i = seq.num_cached
                h = self._hash(seq, i)
                self.blocks.publish(seq.block_table[i], h)
                if i < seq.announced:
                    self._withdraw(h)
                seq.num_cached = i + 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove seq wherever it is and free what it holds."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
            self._unwant(seq)
        self._release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
