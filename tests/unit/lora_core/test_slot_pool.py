import random

import pytest

from lora_core.errors import AdapterDraining, AdapterNotFound, CapacityExceeded, PinRefused
from lora_core.pool import PoolAction, SlotPool


def _pool(max_loras: int = 2, max_cpu: int = 3, keys: str = "") -> SlotPool:
    pool = SlotPool(max_loras, max_cpu)
    for k in keys:
        pool.add(k, f"name-{k}")
    return pool


def test_worked_example_from_docstring() -> None:
    pool = SlotPool(2, 3)
    assert pool.add("a", "A") == [PoolAction("load_cpu", "a")]
    assert pool.add("b", "B") == [PoolAction("load_cpu", "b")]
    assert pool.acquire("a") == (0, [PoolAction("load_slot", "a", 0, "cpu")])
    assert pool.acquire("b") == (1, [PoolAction("load_slot", "b", 1, "cpu")])
    assert pool.release("a") == []
    assert pool.add("c", "C") == [PoolAction("load_cpu", "c")]
    slot, actions = pool.acquire("c")
    assert (slot, actions) == (
        0,
        [PoolAction("evict_slot", "a", 0), PoolAction("load_slot", "c", 0, "cpu")],
    )
    s = pool.stats()
    assert s.slots == ("c", "b") and s.cpu_keys == ("a", "b", "c")
    assert pool.add("d", "D") == [PoolAction("drop_cpu", "a"), PoolAction("load_cpu", "d")]
    s = pool.stats()
    assert s.cpu_keys == ("b", "c", "d")
    assert (s.loads_from_cpu, s.loads_from_disk, s.cpu_loads, s.slot_evictions, s.cpu_drops) == (
        3,
        0,
        4,
        1,
        1,
    )


def test_reload_from_disk_after_cpu_drop() -> None:
    pool = _pool(1, 1, "ab")  # adding b dropped a from the CPU cache
    assert pool.stats().cpu_keys == ("b",)
    slot, actions = pool.acquire("a")
    assert actions == [PoolAction("drop_cpu", "b"), PoolAction("load_slot", "a", 0, "disk")]
    assert pool.stats().cpu_keys == ("a",) and pool.stats().loads_from_disk == 1


def test_add_when_cpu_holds_only_slot_residents_stays_on_disk() -> None:
    pool = _pool(2, 2, "ab")
    pool.acquire("a")
    pool.acquire("b")
    assert pool.add("c", "C") == []
    assert "c" in pool and pool.stats().cpu_keys == ("a", "b")
    assert not pool.can_admit("c")


def test_lru_order_picks_least_recently_used_idle_slot() -> None:
    pool = _pool(3, 5, "abcd")
    for k in "abc":
        pool.acquire(k)
    for k in "bac":
        pool.release(k)  # release order b, a, c: b is least recently used
    slot, actions = pool.acquire("d")
    assert actions[0] == PoolAction("evict_slot", "b", 1) and slot == 1
    pool.release("d")
    pool.acquire("a")  # a becomes most recently used
    pool.release("a")
    _, actions = pool.acquire("b")
    assert actions[0] == PoolAction("evict_slot", "c", 2)


def test_in_use_never_evicted() -> None:
    pool = _pool(2, 4, "abc")
    pool.acquire("a")
    pool.acquire("b")
    assert pool.can_admit("a") and not pool.can_admit("c")
    with pytest.raises(CapacityExceeded, match="all 2 GPU adapter slots"):
        pool.acquire("c")
    assert pool.stats().slots == ("a", "b")
    pool.acquire("a")
    pool.release("a")
    assert not pool.can_admit("c")  # a still has one running request
    pool.release("a")
    assert pool.can_admit("c")
    assert pool.acquire("c")[0] == 0


def test_pin_refused_when_it_would_pin_every_slot() -> None:
    pool = _pool(3, 4, "abcd")
    assert pool.pin("a") == [PoolAction("load_slot", "a", 0, "cpu")]
    pool.pin("b")
    with pytest.raises(PinRefused, match="at most 2 pinned"):
        pool.pin("c")
    assert pool.pin("a") == []  # already pinned: no-op
    pool.acquire("c")
    pool.release("c")
    _, actions = pool.acquire("d")  # only c's slot may be reused
    assert actions[0] == PoolAction("evict_slot", "c", 2)
    pool.release("d")
    pool.unpin("name-a")  # by name: every version
    pool.pin("c")
    assert pool.stats().pinned == ("b", "c")
    assert SlotPool(1, 1).max_loras == 1
    single = _pool(1, 1, "a")
    with pytest.raises(PinRefused):
        single.pin("a")


def test_pin_needs_a_free_slot_now() -> None:
    pool = _pool(2, 3, "abc")
    pool.acquire("a")
    pool.acquire("b")
    with pytest.raises(CapacityExceeded):
        pool.pin("c")
    assert pool.stats().pinned == ()


def test_unload_drains_then_frees() -> None:
    pool = _pool(2, 3, "ab")
    pool.acquire("a")
    pool.acquire("a")
    assert pool.unload("name-a") == []
    with pytest.raises(AdapterDraining):
        pool.acquire("a")
    with pytest.raises(AdapterDraining):
        pool.can_admit("a")
    with pytest.raises(AdapterDraining):
        pool.add("a", "name-a")
    assert pool.stats().draining == ("a",)
    assert pool.release("a") == []
    assert pool.release("a") == [
        PoolAction("evict_slot", "a", 0),
        PoolAction("drop_cpu", "a"),
        PoolAction("forget", "a"),
    ]
    assert "a" not in pool and pool.stats().slots == (None, None)
    with pytest.raises(AdapterNotFound):
        pool.acquire("a")
    assert pool.unload("b") == [PoolAction("drop_cpu", "b"), PoolAction("forget", "b")]


def test_unload_by_name_hits_every_version_and_unpins() -> None:
    pool = SlotPool(3, 4)
    pool.add("x@1", "x")
    pool.add("x@2", "x")
    pool.add("y@1", "y")
    pool.pin("x@1")
    pool.acquire("x@2")
    actions = pool.unload("x")
    assert actions == [
        PoolAction("evict_slot", "x@1", 0),
        PoolAction("drop_cpu", "x@1"),
        PoolAction("forget", "x@1"),
    ]
    assert pool.stats().pinned == () and pool.stats().draining == ("x@2",)
    assert pool.can_admit("y@1")
    with pytest.raises(AdapterNotFound):
        pool.unload("z")


def test_release_without_acquire_is_a_bug() -> None:
    pool = _pool(1, 1, "a")
    with pytest.raises(ValueError, match="without a matching acquire"):
        pool.release("a")
    with pytest.raises(ValueError, match="max_cpu_loras"):
        SlotPool(3, 2)


class _Shadow:
    """A simple model of the pool: replays actions, tracks refcounts, recency and wants."""

    def __init__(self, max_loras: int, max_cpu: int):
        self.slots: list[str | None] = [None] * max_loras
        self.cpu: set[str] = set()
        self.refs: dict[str, int] = {}
        self.pinned: set[str] = set()
        self.draining: set[str] = set()
        self.gpu_tick: dict[str, int] = {}
        self.tick = 0
        self.cpu_lru: list[str] = []  # least recently used first
        self.wanted: dict[str, int] = {}
        self.want_tick: dict[str, int] = {}

    def replay(self, actions: list[PoolAction]) -> None:
        for a in actions:
            if a.kind == "load_cpu":
                assert a.key not in self.cpu
                self.cpu.add(a.key)
                self.cpu_lru.append(a.key)
            elif a.kind == "drop_cpu":
                assert (
                    a.key in self.cpu and a.key not in self.slots and self.refs.get(a.key, 0) == 0
                )
                self._check_cpu_victim(a.key)
                self.cpu.remove(a.key)
                self.cpu_lru.remove(a.key)
            elif a.kind == "evict_slot":
                assert self.slots[a.slot] == a.key and self.refs.get(a.key, 0) == 0
                assert a.key not in self.pinned or a.key in self.draining
                self._check_lru_victim(a.key)
                self.slots[a.slot] = None
            elif a.kind == "load_slot":
                assert self.slots[a.slot] is None
                assert (a.source == "cpu") == (a.key in self.cpu)
                if a.key not in self.cpu:
                    self.cpu_lru.append(a.key)
                self.cpu.add(a.key)
                self.slots[a.slot] = a.key
            elif a.kind == "forget":
                assert a.key not in self.cpu and a.key not in self.slots
                self.refs.pop(a.key, None)
                self.draining.discard(a.key)

    def _check_lru_victim(self, key: str) -> None:
        if key in self.draining:
            return
        idle = [k for k in self.slots if k and self.refs.get(k, 0) == 0 and k not in self.pinned]
        assert None not in self.slots, "evicted although a slot was free"
        assert self.gpu_tick[key] == min(self.gpu_tick[k] for k in idle)

    def _check_cpu_victim(self, key: str) -> None:
        """The LRU droppable entry nobody wants; else the droppable one wanted last."""
        if key in self.draining:
            return  # purged, not chosen
        droppable = [k for k in self.cpu_lru if k not in self.slots]
        unwanted = [k for k in droppable if not self.wanted.get(k)]
        if unwanted:
            assert key == unwanted[0]
        else:
            assert key == max(droppable, key=lambda k: self.want_tick[k])

    def cpu_touch(self, key: str) -> None:
        if key in self.cpu:
            self.cpu_lru.remove(key)
            self.cpu_lru.append(key)

    def want(self, key: str, delta: int) -> None:
        self.wanted[key] = self.wanted.get(key, 0) + delta
        if self.wanted[key] == 0:
            del self.wanted[key]
        elif delta > 0 and self.wanted[key] == 1:
            self.tick += 1
            self.want_tick[key] = self.tick

    def touch(self, key: str) -> None:
        self.tick += 1
        self.gpu_tick[key] = self.tick


def _check_invariants(pool: SlotPool, shadow: _Shadow) -> None:
    s = pool.stats()
    assert list(s.slots) == shadow.slots
    assert set(s.cpu_keys) == shadow.cpu and len(s.cpu_keys) <= pool.max_cpu_loras
    assert list(s.cpu_keys) == shadow.cpu_lru
    assert s.wanted == tuple(sorted(shadow.wanted, key=shadow.want_tick.__getitem__))
    assert all(pool.wanted(k) == n for k, n in shadow.wanted.items())
    assert set(s.gpu_keys) <= shadow.cpu
    assert set(s.pinned) == shadow.pinned and len(shadow.pinned) <= pool.max_loras - 1
    assert shadow.pinned <= set(s.gpu_keys)
    for key, n in shadow.refs.items():
        assert pool.refcount(key) == n
        if n:
            assert pool.slot_of(key) is not None
    assert len(set(s.gpu_keys)) == len(s.gpu_keys)


@pytest.mark.parametrize("seed", range(10))
def test_random_operations_keep_invariants(seed: int) -> None:
    rng = random.Random(seed)
    max_loras = rng.randint(1, 4)
    max_cpu = rng.randint(max_loras, max_loras + 3)
    pool, shadow = SlotPool(max_loras, max_cpu), _Shadow(max_loras, max_cpu)
    keys = [f"k{i}" for i in range(8)]
    for _ in range(400):
        key = rng.choice(keys)
        op = rng.choice(
            ["add", "cache", "acquire", "acquire", "release", "release", "pin", "unpin", "unload"]
            + ["want", "want", "unwant"]
        )
        live = key in pool and key not in shadow.draining
        if op == "add":
            if key in shadow.draining:
                with pytest.raises(AdapterDraining):
                    pool.add(key, key)
                continue
            shadow.refs.setdefault(key, 0)
            shadow.cpu_touch(key)
            shadow.replay(pool.add(key, key))
        elif op == "cache" and live:
            room = (
                key in shadow.cpu
                or len(shadow.cpu) < max_cpu
                or bool(shadow.cpu - set(shadow.slots))
            )
            shadow.cpu_touch(key)
            shadow.replay(pool.cache(key))
            assert (key in shadow.cpu) == room
        elif op == "acquire":
            if not live:
                with pytest.raises(AdapterNotFound if key not in pool else AdapterDraining):
                    pool.acquire(key)
                continue
            room = key in shadow.slots or any(
                k is None or (shadow.refs[k] == 0 and k not in shadow.pinned) for k in shadow.slots
            )
            assert pool.can_admit(key) == room
            if not room:
                with pytest.raises(CapacityExceeded):
                    pool.acquire(key)
                continue
            slot, actions = pool.acquire(key)
            shadow.replay(actions)
            shadow.cpu_touch(key)
            shadow.refs[key] += 1
            shadow.touch(key)
            assert shadow.slots[slot] == key
        elif op == "release":
            if shadow.refs.get(key, 0) == 0:
                continue
            shadow.refs[key] -= 1
            shadow.touch(key)
            shadow.replay(pool.release(key))
        elif op == "pin" and live:
            try:
                actions = pool.pin(key)
            except PinRefused:
                assert len(shadow.pinned | {key}) >= max_loras
                continue
            except CapacityExceeded:
                assert key not in shadow.slots
                continue
            shadow.replay(actions)
            if key not in shadow.pinned:
                shadow.gpu_tick.setdefault(key, 0)
                if actions:
                    shadow.touch(key)
            shadow.pinned.add(key)
        elif op == "unpin" and key in pool:
            pool.unpin(key)
            shadow.pinned.discard(key)
        elif op == "unload" and key in pool:
            shadow.draining.add(key)
            shadow.pinned.discard(key)
            shadow.replay(pool.unload(key))
        elif op == "want":
            pool.want(key)
            shadow.want(key, 1)
        elif op == "unwant":
            if not shadow.wanted.get(key):
                with pytest.raises(ValueError, match="without a matching want"):
                    pool.unwant(key)
                continue
            pool.unwant(key)
            shadow.want(key, -1)
        _check_invariants(pool, shadow)
