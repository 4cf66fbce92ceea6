"""The scheduler's waiting queue: waiting sequences in scheduling order, kept per adapter,
so a scan can pass over every request of an adapter that cannot get a slot in one look
(`replica.scheduler`)."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator, KeysView

from replica.sequence import Sequence


class WaitingQueue:
    """Waiting sequences in scheduling order, kept per adapter.

    The order: preempted sequences first (the latest preempted in front), then the
    others in arrival order. Each sequence gets a position when queued: append() the
    next one after every position handed out, appendleft() the next one before; the
    order is by position. Each adapter key ("" for base requests) has a group, an
    OrderedDict seq -> position in the same order (appendleft puts a sequence first in
    O(1)), and a heap holds (position of a group's first sequence, key); an entry whose
    group's first sequence has changed since is stale and dropped when it reaches the top.

    Example: append a1, b1, a2, then appendleft p (adapter b, preempted): positions
    a1=0, b1=1, a2=2, p=-1; groups a: {a1: 0, a2: 2}, b: {p: -1, b1: 1}; heap
    (-1, b), (0, a); order p, a1, b1, a2. A scan that passes over adapter a (no slot
    for it) sees p, a1, then b1, and never looks at a2.

    Within a group, sequences holding their slot (preempted: appendleft) come before
    those that need one (append), so once a group's first sequence needs a slot, all
    of its sequences do.
    """

    def __init__(self) -> None:
        self._groups: dict[str, OrderedDict[Sequence, int]] = {}
        self._heap: list[tuple[int, str]] = []
        self._passed: list[tuple[int, str]] = []
        self._first: tuple[int, str] | None = None  # the heap entry first() answered from
        self._back, self._front, self._len = 0, -1, 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self._groups.get(seq.adapter_key, ())

    def __iter__(self) -> Iterator[Sequence]:
        """Every waiting sequence in scheduling order (O(N log A); for tests and tools)."""
        merged = heapq.merge(*(g.items() for g in self._groups.values()), key=lambda i: i[1])
        return (seq for seq, _ in merged)

    def adapter_keys(self) -> KeysView[str]:
        """Keys of the groups with a waiting sequence ("" for base requests)."""
        return self._groups.keys()

    def append(self, seq: Sequence) -> None:
        self._insert(seq, self._back)
        self._back += 1

    def appendleft(self, seq: Sequence) -> None:
        self._insert(seq, self._front)
        self._front -= 1

    def _insert(self, seq: Sequence, pos: int) -> None:
        key = seq.adapter_key
        group = self._groups.setdefault(key, OrderedDict())
        group[seq] = pos
        if pos < 0:
            group.move_to_end(seq, last=False)
        if next(iter(group)) is seq:
            heapq.heappush(self._heap, (pos, key))
        self._len += 1

    def remove(self, seq: Sequence) -> None:
        key = seq.adapter_key
        group = self._groups[key]
        first = next(iter(group)) is seq
        del group[seq]
        self._len -= 1
        if not group:
            del self._groups[key]
        elif first:
            heapq.heappush(self._heap, (next(iter(group.values())), key))

    def first(self) -> Sequence | None:
        """The first sequence in order, leaving out groups passed over in this scan."""
        heap = self._heap
        while heap:
            pos, key = heap[0]
            group = self._groups.get(key)
            if group is not None and next(iter(group.values())) == pos:
                self._first = heap[0]
                return next(iter(group))
            heapq.heappop(heap)  # stale
        return None

    def pass_over(self) -> None:
        """Leave the group of the sequence first() returned out of first() until end_scan()."""
        assert self._heap and self._heap[0] is self._first, "pass_over() right after first()"
        entry = heapq.heappop(self._heap)
        while self._heap and self._heap[0] == entry:  # pushed again when it became first again
            heapq.heappop(self._heap)
        self._passed.append(entry)

    def end_scan(self) -> None:
        """Put the passed-over groups back; drop stale entries once they outnumber groups."""
        for entry in self._passed:
            heapq.heappush(self._heap, entry)
        self._passed.clear()
        if len(self._heap) > 2 * len(self._groups) + 16:
            self._heap = [(next(iter(g.values())), k) for k, g in self._groups.items()]
            heapq.heapify(self._heap)
