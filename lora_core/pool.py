"""Adapter residency: GPU slots (LRU) and a CPU cache (LRU, sparing wanted adapters); pure
logic, torch-free.

The pool decides; the torch side (`lora_core.manager`) executes the `PoolAction`s
each call returns, in order. Invariants (checked by the tests after every call):
    (in use (refcount > 0) ∪ pinned) ⊆ in a GPU slot ⊆ in the CPU cache
    |GPU| <= max_loras, |CPU| <= max_cpu_loras, pinned <= max_loras - 1
An adapter in use is never evicted; a pinned one never leaves its slot; an adapter
dropped from the CPU cache is reloaded from disk when next needed.

Worked example (max_loras=2, max_cpu_loras=3): add a, add b -> CPU [a, b];
acquire a -> slot 0 <- a (cpu); acquire b -> slot 1 <- b (cpu); release a;
add c -> CPU [a, b, c]; acquire c -> evict a from slot 0, slot 0 <- c (cpu);
add d -> drop a from CPU (the LRU entry not in a slot), load d into CPU.
A key must be added before it is acquired; if its CPU copy was dropped meanwhile,
acquire loads it into the slot from disk.

Wanted keys: the scheduler calls want(key) for each request queued for a slot and
unwant(key) once it gets the slot, fails or is aborted. A CPU drop takes the LRU entry
outside the slots that nobody wants; when queued requests want all of them, the one
wanted most recently (first wanted last: its requests come last in FIFO order), so
the adapter of the longest-waiting request is not the one dropped while another can
go. Example (max_loras=1, max_cpu_loras=3): a holds the slot, b then c are wanted,
CPU [a, b, c]; add d -> drop c (LRU would drop b, the one needed first).

Yielding: a slot frees only when its adapter's last running request ends, so adapters
with steady traffic would keep every slot forever and a wanted adapter would wait
forever. While a wanted live adapter has no slot and none is free or idle, the
unpinned adapter in a slot with the fewest running requests yields it (`yields_slot`;
the engine's admission check refuses its new requests): it drains, and the wanted
adapter takes its slot. Example (max_loras=2): a runs 1 request, b 2, c is wanted ->
a yields; a's request ends -> c takes slot 0; a is now wanted and b or c, whichever
runs fewer, yields in turn. An adapter placed in a slot first lets the requests queued
for it by then take the slot (its turn): yielding right after the first of them would
run one request per slot load, one at a time, while both adapters have many queued.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from lora_core.errors import AdapterDraining, AdapterNotFound, CapacityExceeded, PinRefused

LOAD_CPU = "load_cpu"
DROP_CPU = "drop_cpu"
LOAD_SLOT = "load_slot"
EVICT_SLOT = "evict_slot"
FORGET = "forget"


@dataclass(frozen=True)
class PoolAction:
    """One step for the torch side.

    kind: "load_cpu" (read key from disk into the CPU cache), "drop_cpu" (free its CPU
        copy), "load_slot" (copy key into GPU `slot`; source "cpu", or "disk": read it
        first, it then stays in the CPU cache), "evict_slot" (key leaves `slot`),
        "forget" (an unloaded key is gone; drop everything known about it).
    """

    kind: str
    key: str
    slot: int | None = None
    source: str | None = None


@dataclass
class _Entry:
    name: str
    refcount: int = 0
    pinned: bool = False
    draining: bool = False
    slot: int | None = None
    in_cpu: bool = False
    turn: int = 0
    """Acquires still due to the requests queued for it when it was placed in its slot
    (until then it does not yield: see "Yielding")."""


@dataclass(frozen=True)
class PoolStats:
    """slots: key per GPU slot (None = free); cpu_keys: the CPU cache, LRU first;
    wanted: keys queued requests wait for, in the order they were first wanted."""

    slots: tuple[str | None, ...]
    cpu_keys: tuple[str, ...]
    pinned: tuple[str, ...]
    draining: tuple[str, ...]
    wanted: tuple[str, ...]
    loads_from_cpu: int
    loads_from_disk: int
    cpu_loads: int
    slot_evictions: int
    cpu_drops: int
    gpu_keys: tuple[str, ...] = field(init=False)
    free_slots: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpu_keys", tuple(k for k in self.slots if k is not None))
        object.__setattr__(self, "free_slots", sum(k is None for k in self.slots))

    @property
    def slot_loads(self) -> int:
        """GPU slot loads since start (from CPU or disk); EngineStats.adapter_loads."""
        return self.loads_from_cpu + self.loads_from_disk

    # Short names the engine's EngineStats mapping reads.
    @property
    def gpu(self) -> tuple[str, ...]:
        return self.gpu_keys

    @property
    def cpu(self) -> tuple[str, ...]:
        return self.cpu_keys

    @property
    def loads(self) -> int:
        return self.slot_loads


class SlotPool:
    """GPU slots (max_loras) and CPU cache (max_cpu_loras >= max_loras), keyed by AdapterRef.key."""

    def __init__(self, max_loras: int, max_cpu_loras: int):
        if max_loras < 1 or max_cpu_loras < max_loras:
            raise ValueError(
                f"max_loras={max_loras}, max_cpu_loras={max_cpu_loras}; "
                "allowed: 1 <= max_loras <= max_cpu_loras"
            )
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self._entries: dict[str, _Entry] = {}
        self._slots: list[str | None] = [None] * max_loras
        self._gpu_lru: OrderedDict[str, None] = OrderedDict()
        self._cpu_lru: OrderedDict[str, None] = OrderedDict()
        # key -> queued requests waiting for it (> 0), in the order keys became wanted;
        # kept apart from _entries: an unload forgets a key its queued requests still count
        self._wanted: dict[str, int] = {}
        self._counts = dict.fromkeys(
            ("loads_from_cpu", "loads_from_disk", "cpu_loads", "slot_evictions", "cpu_drops"), 0
        )

    # -- queries -------------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def slot_of(self, key: str) -> int | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.slot

    def refcount(self, key: str) -> int:
        entry = self._entries.get(key)
        return 0 if entry is None else entry.refcount

    def wanted(self, key: str) -> int:
        """Queued requests waiting for key (want() calls not yet matched by unwant())."""
        return self._wanted.get(key, 0)

    def can_admit(self, key: str) -> bool:
        """True when acquire(key) would succeed now; False means wait (slots busy).

        Raises AdapterNotFound / AdapterDraining: the request must fail, not wait.
        """
        entry = self._live(key)
        return entry.slot is not None or self._slot_victim() is not None

    def yields_slot(self, key: str) -> bool:
        """True when new requests for `key`, which holds a slot, should wait so that its
        slot goes to another adapter: a live adapter that queued requests want has no
        slot, no other slot is free or idle, and key is the unpinned adapter in a slot
        with the fewest running requests, the LRU one among equals (only it drains, the
        others keep serving). See "Yielding" in the module docstring.
        """
        entry = self._entries.get(key)
        if entry is None or entry.slot is None or entry.pinned or entry.draining or entry.turn:
            return False
        if not any(self._waits_for_slot(w) for w in self._wanted if w != key):
            return False
        if self._slot_victim(besides=key) is not None:
            return False
        # The fewest running, not the LRU: a release moves its adapter to the LRU end,
        # so the LRU one changes as requests end and none would drain. The one chosen
        # takes no new requests, so it stays the one until it or another reaches 0.
        unpinned = (k for k in self._gpu_lru if not self._entries[k].pinned)
        return min(unpinned, key=lambda k: self._entries[k].refcount) == key

    def stats(self) -> PoolStats:
        return PoolStats(
            slots=tuple(self._slots),
            cpu_keys=tuple(self._cpu_lru),
            pinned=tuple(k for k, e in self._entries.items() if e.pinned),
            draining=tuple(k for k, e in self._entries.items() if e.draining),
            wanted=tuple(self._wanted),
            **self._counts,
        )

    # -- operations ----------------------------------------------------------------

    def add(self, key: str, name: str) -> list[PoolAction]:
        """Know `key` and cache it on CPU if room can be made (else it stays on disk)."""
        entry = self._entries.get(key)
        if entry is not None:
            if entry.draining:
                raise AdapterDraining(entry.name)
            if entry.in_cpu:
                self._cpu_lru.move_to_end(key)
            return []
        self._entries[key] = _Entry(name)
        return self.cache(key)

    def cache(self, key: str) -> list[PoolAction]:
        """Bring a known `key` back into the CPU cache if room can be made (prefetch)."""
        entry = self._live(key)
        if entry.in_cpu:
            self._cpu_lru.move_to_end(key)
            return []
        drops = self._make_cpu_room()
        if drops is None:
            return []
        self._cache(key)
        self._counts["cpu_loads"] += 1
        return [*drops, PoolAction(LOAD_CPU, key)]

    def acquire(self, key: str) -> tuple[int, list[PoolAction]]:
        """Hold `key` in a GPU slot for one running request; (slot, actions to run first).

        Raises CapacityExceeded when every slot holds an in-use or pinned adapter
        (call can_admit first), AdapterNotFound / AdapterDraining as can_admit does.
        """
        entry = self._live(key)
        actions = [] if entry.slot is not None else self._place(key, entry)
        entry.turn = max(0, entry.turn - 1)
        entry.refcount += 1
        self._gpu_lru.move_to_end(key)
        self._cpu_lru.move_to_end(key)
        return entry.slot, actions

    def release(self, key: str) -> list[PoolAction]:
        """A request using `key` finished; purges it if it was being unloaded."""
        entry = self._entries.get(key)
        if entry is None or entry.refcount == 0:
            raise ValueError(f"release({key!r}) without a matching acquire")
        entry.refcount -= 1
        self._gpu_lru.move_to_end(key)
        if entry.refcount == 0 and entry.draining:
            return self._purge(key)
        return []

    def want(self, key: str) -> None:
        """One more queued request waits for key: spare its CPU copy while another can go."""
        self._wanted[key] = self._wanted.get(key, 0) + 1

    def unwant(self, key: str) -> None:
        """A request that waited for key got its slot, failed or was aborted."""
        n = self._wanted.get(key, 0)
        if n == 0:
            raise ValueError(f"unwant({key!r}) without a matching want")
        if n == 1:
            del self._wanted[key]
        else:
            self._wanted[key] = n - 1

    def pin(self, key: str) -> list[PoolAction]:
        """Keep `key` in a GPU slot until unpinned (loads it now if needed)."""
        entry = self._live(key)
        if entry.pinned:
            return []
        pinned = sum(e.pinned for e in self._entries.values())
        if pinned + 1 >= self.max_loras:
            raise PinRefused(
                f"pinning {key!r} would pin every one of the {self.max_loras} GPU slots; "
                f"allowed: at most {self.max_loras - 1} pinned adapters"
            )
        actions = [] if entry.slot is not None else self._place(key, entry)
        entry.pinned = True
        return actions

    def unpin(self, name_or_key: str) -> list[PoolAction]:
        """Every version of a name (or one key) stays resident but becomes evictable again."""
        for key in self._matching(name_or_key):
            self._entries[key].pinned = False
        return []

    def unload(self, name_or_key: str) -> list[PoolAction]:
        """Refuse new acquires of every version of a name (or one key) at once; free each
        slot and CPU copy as soon as its last request releases it."""
        actions: list[PoolAction] = []
        for key in self._matching(name_or_key):
            entry = self._entries[key]
            entry.draining, entry.pinned = True, False
            if entry.refcount == 0:
                actions += self._purge(key)
        return actions

    # -- internals -----------------------------------------------------------------

    def _matching(self, name_or_key: str) -> list[str]:
        keys = [k for k, e in self._entries.items() if name_or_key in (k, e.name)]
        if not keys:
            raise AdapterNotFound(name_or_key)
        return keys

    def _live(self, key: str) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise AdapterNotFound(key)
        if entry.draining:
            raise AdapterDraining(entry.name)
        return entry

    def _slot_victim(self, besides: str | None = None) -> int | None:
        """A free slot (lowest first), else the slot of the LRU idle unpinned adapter
        (other than `besides`)."""
        for slot, key in enumerate(self._slots):
            if key is None:
                return slot
        for key in self._gpu_lru:
            entry = self._entries[key]
            if entry.refcount == 0 and not entry.pinned and key != besides:
                return entry.slot
        return None

    def _waits_for_slot(self, key: str) -> bool:
        """Queued requests want `key`, a live adapter outside the slots."""
        entry = self._entries.get(key)
        return entry is not None and entry.slot is None and not entry.draining

    def _place(self, key: str, entry: _Entry) -> list[PoolAction]:
        slot = self._slot_victim()
        if slot is None:
            raise CapacityExceeded(
                f"all {self.max_loras} GPU adapter slots hold adapters of running requests "
                "or pinned adapters; retry when one finishes"
            )
        actions = self._evict_slot(slot)
        if entry.in_cpu:
            source = "cpu"
        else:
            source = "disk"
            drops = self._make_cpu_room()
            assert drops is not None, "max_cpu_loras >= max_loras leaves a droppable entry"
            actions += drops
            self._cache(key)
        self._counts["loads_from_cpu" if source == "cpu" else "loads_from_disk"] += 1
        entry.slot = slot
        entry.turn = self._wanted.get(key, 0)  # an acquire's own request is still wanted
        self._slots[slot] = key
        self._gpu_lru[key] = None
        actions.append(PoolAction(LOAD_SLOT, key, slot, source))
        return actions

    def _evict_slot(self, slot: int) -> list[PoolAction]:
        old = self._slots[slot]
        if old is None:
            return []
        self._entries[old].slot = None
        self._slots[slot] = None
        del self._gpu_lru[old]
        self._counts["slot_evictions"] += 1
        return [PoolAction(EVICT_SLOT, old, slot)]

    def _make_cpu_room(self) -> list[PoolAction] | None:
        """Drops that leave room for one more CPU entry; None when everything is in a slot.

        The victim: the LRU entry outside the slots that no queued request wants, else
        the wanted one first wanted last (see the module docstring).
        """
        if len(self._cpu_lru) < self.max_cpu_loras:
            return []
        for key in self._cpu_lru:
            if self._entries[key].slot is None and key not in self._wanted:
                return [self._drop_cpu(key)]
        for key in reversed(self._wanted):
            entry = self._entries.get(key)
            if entry is not None and entry.in_cpu and entry.slot is None:
                return [self._drop_cpu(key)]
        return None

    def _cache(self, key: str) -> None:
        self._entries[key].in_cpu = True
        self._cpu_lru[key] = None

    def _drop_cpu(self, key: str) -> PoolAction:
        self._entries[key].in_cpu = False
        del self._cpu_lru[key]
        self._counts["cpu_drops"] += 1
        return PoolAction(DROP_CPU, key)

    def _purge(self, key: str) -> list[PoolAction]:
        entry = self._entries[key]
        actions = self._evict_slot(entry.slot) if entry.slot is not None else []
        if entry.in_cpu:
            actions.append(self._drop_cpu(key))
        del self._entries[key]
        actions.append(PoolAction(FORGET, key))
        return actions
