"""The CPU cache spares adapters that queued requests want: the LRU entry nobody wants
goes first; when every droppable entry is wanted, the one wanted last goes, so the
longest-waiting request's adapter stays through any churn of newer adapters."""

import pytest

from lora_core.pool import PoolAction, SlotPool


def _busy_pool(max_cpu: int) -> SlotPool:
    """One slot, held by a running request of "run"."""
    pool = SlotPool(1, max_cpu)
    pool.add("run", "run")
    pool.acquire("run")
    return pool


def test_an_unwanted_entry_goes_before_a_wanted_older_one():
    pool = _busy_pool(3)
    pool.add("old", "old")
    pool.want("old")  # its request waits for the busy slot
    pool.add("done", "done")  # nobody waits for it
    assert pool.stats().cpu_keys == ("run", "old", "done")
    assert pool.add("new", "new") == [PoolAction("drop_cpu", "done"), PoolAction("load_cpu", "new")]
    assert pool.stats().wanted == ("old",) and pool.wanted("old") == 1


def test_under_churn_the_longest_wanted_adapter_stays_cached():
    """Each new adapter's request queues behind "first": when all droppable entries are
    wanted, the newest goes (LRU dropped "first" at the second newcomer)."""
    pool = _busy_pool(3)
    pool.add("first", "first")
    pool.want("first")
    drops = []
    for key in ("k0", "k1", "k2", "k3"):
        drops += [a.key for a in pool.add(key, key) if a.kind == "drop_cpu"]
        pool.want(key)
        assert "first" in pool.stats().cpu_keys
    assert drops == ["k0", "k1", "k2"]
    assert pool.stats().wanted == ("first", "k0", "k1", "k2", "k3")
    assert len(pool.stats().cpu_keys) == 3


def test_a_slot_load_drops_a_wanted_entry_when_it_must():
    """Nothing deadlocks: with every droppable entry wanted, a slot load from disk still
    makes room (the entry wanted last), and the cache never grows past its bound."""
    pool = _busy_pool(2)
    pool.add("a", "a")
    pool.want("a")
    pool.add("b", "b")  # "a", the only droppable entry, goes although wanted
    pool.want("b")
    assert pool.stats().cpu_keys == ("run", "b")
    pool.release("run")
    pool.unwant("a")  # a's request is admitted now
    slot, actions = pool.acquire("a")
    assert actions == [
        PoolAction("evict_slot", "run", 0),
        PoolAction("drop_cpu", "run"),  # not wanted: goes before b
        PoolAction("load_slot", "a", 0, "disk"),
    ]
    pool.release("a")
    pool.want("c")
    pool.add("c", "c")  # only b can go (a is in the slot), wanted or not
    assert pool.stats().cpu_keys == ("a", "c") and pool.stats().cpu_drops == 3


def test_unwant_without_want_is_a_bug_and_counts_outlive_an_unload():
    pool = SlotPool(1, 1)
    with pytest.raises(ValueError, match="without a matching want"):
        pool.unwant("a")
    pool.add("a", "a")
    pool.want("a")
    pool.want("a")
    pool.unload("a")  # forgotten, but its two queued requests still count until they fail
    assert "a" not in pool and pool.wanted("a") == 2
    pool.unwant("a")
    pool.unwant("a")
    assert pool.stats().wanted == () and pool.wanted("a") == 0
    with pytest.raises(ValueError):
        pool.unwant("a")


def _two_busy() -> SlotPool:
    """Two slots held by running requests: a runs one, b two."""
    pool = SlotPool(2, 4)
    for key in ("a", "b", "c"):
        pool.add(key, key)
    pool.acquire("a")
    pool.acquire("b")
    pool.acquire("b")
    return pool


def test_the_busy_adapter_running_fewest_yields_its_slot_to_a_wanted_one():
    """The module docstring's example: only a (fewest running) yields; once its running
    request ends, c gets a's slot, and then c (one running, b two) yields to a."""
    pool = _two_busy()
    assert not pool.yields_slot("a")  # nobody waits
    pool.want("c")
    assert pool.yields_slot("a") and not pool.yields_slot("b")
    assert pool.can_admit("a")  # acquire would still succeed: yielding is advice
    pool.release("b")  # b now runs one too, and a is the LRU of the two: a still drains
    assert pool.yields_slot("a") and not pool.yields_slot("b")
    pool.release("a")
    assert pool.yields_slot("a") and pool.can_admit("c")  # a's idle slot is c's
    pool.unwant("c")
    assert pool.acquire("c")[0] == 0
    pool.want("a")
    assert pool.yields_slot("c") != pool.yields_slot("b")  # exactly one of them drains


@pytest.mark.parametrize("case", ["free slot", "idle slot", "pinned", "draining", "resident"])
def test_no_yield_when_the_wanted_adapter_has_another_way_in(case):
    pool = _two_busy()
    pool.want("c")
    if case in ("free slot", "idle slot", "resident"):
        pool.release("b")
        pool.release("b")  # b is idle: c would take its slot, a keeps serving
    if case == "free slot":
        pool.unload("b")  # b's slot is empty now
    elif case == "pinned":
        pool.pin("a")  # a pinned never yields; b is the unpinned one left
        assert pool.yields_slot("b")
    elif case == "draining":
        pool.unload("c")  # c's requests fail rather than wait
    elif case == "resident":
        pool.acquire("c")  # c already holds a slot
    assert not pool.yields_slot("a")


def test_an_adapter_placed_for_queued_requests_yields_only_after_they_took_it():
    """a gets the free slot with 3 requests queued for it: all 3 may take the slot before
    a yields to the waiting b (a request queued after the placement does not extend it)."""
    pool = SlotPool(1, 4)
    for key in ("a", "b"):
        pool.add(key, key)
    for _ in range(3):
        pool.want("a")
    pool.want("b")
    for taken in range(3):
        assert not pool.yields_slot("a") or taken == 0 and pool.slot_of("a") is None
        pool.acquire("a")
        pool.unwant("a")
    pool.want("a")  # queued after a got its slot
    assert pool.yields_slot("a")
