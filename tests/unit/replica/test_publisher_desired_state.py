"""How the registry publisher applies a desired state (pure: fake registry and engine).

Order (unpins, pins, warm targets, draining), one refusal not stopping the rest,
"not applied" until every step succeeded, each failure logged once per version, warm
copies loaded only as the registry grants claims on them.
The same flows against a real Redis are in tests/integration/serve/test_replica_registry.py.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from cluster.records import DesiredState, WarmTarget
from lora_core.errors import AdapterNotFound, PinRefused, RegistryUnavailable
from lora_core.identity import AdapterRef
from replica.desired_state import OncePerVersion, attempt
from replica.outputs import EngineStats
from replica.serve_registry import PublisherConfig, RegistryPublisher


def ref(name: str) -> AdapterRef:
    return AdapterRef(name, 1, "ab" * 32, f"/adapters/{name}", 8, "base")


class FakeRegistry:
    """Grants every warm claim but those in full (or raises claim_error)."""

    def __init__(self, state: DesiredState, claim_error: Exception | None = None):
        self.state = state
        self.claim_error = claim_error
        self.full: set[str] = set()
        self.claims: list[list[str]] = []

    async def desired_state(self) -> DesiredState:
        return self.state

    async def claim_warm(self, replica_id, epoch, names, claim_s) -> list[str]:
        if self.claim_error is not None:
            raise self.claim_error
        self.claims.append(list(names))
        return [n for n in names if n not in self.full]


class FakeEngine:
    """Refuses pins of the names in refuse; holds only the names in held."""

    def __init__(self, refuse: set[str], held: set[str]):
        self.refuse, self.held = refuse, held
        self.calls: list[tuple[str, str]] = []

    def stats(self) -> EngineStats:
        return EngineStats((), (), (), 2, 2, 0, 0, 0.0, 0, 0, 0)

    async def load_adapter(self, ref: AdapterRef, to_gpu: bool = False) -> None:
        self.calls.append(("load", ref.name))

    def pin(self, ref: AdapterRef) -> None:
        if ref.name in self.refuse:
            raise PinRefused(f"pinning {ref.name!r} would pin every one of the 2 GPU slots")
        self.calls.append(("pin", ref.name))

    def unpin(self, name: str) -> None:
        if name not in self.held:
            raise AdapterNotFound(name)
        self.calls.append(("unpin", name))

    async def unload_adapter(self, name: str) -> None:
        if name not in self.held:
            raise AdapterNotFound(name)
        self.calls.append(("unload", name))


def state(version: int, pins=(), warm=(), draining=()) -> DesiredState:
    names = set(pins) | set(warm)
    return DesiredState(
        version=version,
        pins={n: "all" for n in pins},
        warm={n: WarmTarget(1, "all") for n in warm},
        draining=frozenset(draining),
        refs={n: ref(n) for n in names},
    )


def publisher(
    registry: FakeRegistry, engine: FakeEngine, pinned=(), pool: str = "mixed"
) -> RegistryPublisher:
    pub = RegistryPublisher(PublisherConfig("r1", "d", pool=pool), registry, engine, {})
    pub.desired.pinned = {n: ref(n).key for n in pinned}
    return pub


def test_refused_pin_lets_unpins_warm_and_draining_run_and_retries():
    engine = FakeEngine(refuse={"b"}, held={"old", "gone"})
    reg = FakeRegistry(state(7, pins=("a", "b"), warm=("w",), draining=("gone",)))
    pub = publisher(reg, engine, pinned={"old"})
    asyncio.run(pub.desired.follow(1))
    assert engine.calls == [
        ("unpin", "old"),
        ("load", "a"),
        ("pin", "a"),
        ("load", "b"),  # loaded, then its pin refused
        ("load", "w"),
        ("unload", "gone"),
    ]
    assert set(pub.desired.pinned) == {"a"}
    assert pub.desired.version == -1  # not applied: the next tick tries b again
    engine.refuse = set()
    asyncio.run(pub.desired.follow(1))
    assert set(pub.desired.pinned) == {"a", "b"} and pub.desired.version == 7


def test_names_this_replica_does_not_hold_are_nothing_to_unpin_or_unload():
    engine = FakeEngine(refuse=set(), held=set())
    pub = publisher(FakeRegistry(state(3, draining=("never-here",))), engine, pinned={"gone"})
    asyncio.run(pub.desired.follow(1))
    assert (engine.calls, pub.desired.pinned, pub.desired.version) == ([], {}, 3)


@pytest.mark.parametrize(
    ("pool", "binding"),
    [
        ("mixed", {"all", "prefill", "decode"}),
        ("prefill", {"all", "prefill"}),
        ("decode", {"all", "decode"}),
    ],
)
def test_pins_and_warm_targets_bind_only_their_pools(pool: str, binding: set[str]):
    pools = ("all", "prefill", "decode")
    desired = DesiredState(
        version=2,
        pins={f"pin-{p}": p for p in pools},
        warm={f"warm-{p}": WarmTarget(1, p) for p in pools},
        draining=frozenset(),
        refs={n: ref(n) for p in pools for n in (f"pin-{p}", f"warm-{p}")},
    )
    engine = FakeEngine(refuse=set(), held=set())
    pub = publisher(FakeRegistry(desired), engine, pool=pool)
    asyncio.run(pub.desired.follow(1))
    assert set(pub.desired.pinned) == {f"pin-{p}" for p in binding}
    assert {n for c, n in engine.calls if c == "load"} == {
        f"{kind}-{p}" for kind in ("pin", "warm") for p in binding
    }


def test_a_pin_that_stops_binding_this_pool_is_released():
    engine = FakeEngine(refuse=set(), held={"a"})
    reg = FakeRegistry(state(1, pins=("a",)))
    pub = publisher(reg, engine, pool="decode")
    asyncio.run(pub.desired.follow(1))
    reg.state = DesiredState(2, {"a": "prefill"}, {}, frozenset(), {"a": ref("a")})
    asyncio.run(pub.desired.follow(1))
    assert engine.calls == [("load", "a"), ("pin", "a"), ("unpin", "a")]
    assert pub.desired.pinned == {} and pub.desired.version == 2


def test_a_replaced_pinned_adapter_pins_its_new_version():
    engine = FakeEngine(refuse=set(), held={"a"})
    reg = FakeRegistry(state(1, pins=("a",)))
    pub = publisher(reg, engine)
    asyncio.run(pub.desired.follow(1))
    v2 = AdapterRef("a", 2, "cd" * 32, "/adapters/a-v2", 8, "base")
    reg.state = DesiredState(2, {"a": "all"}, {}, frozenset(), {"a": v2})
    asyncio.run(pub.desired.follow(1))
    # the old version lets go of its slot before the new one is pinned
    assert engine.calls == [
        ("load", "a"),
        ("pin", "a"),
        ("unpin", "a"),
        ("load", "a"),
        ("pin", "a"),
    ]
    assert pub.desired.pinned == {"a": v2.key} and pub.desired.version == 2


def test_warm_targets_load_only_the_copies_the_registry_grants():
    """One claim for every target not held here; only granted names are loaded (the
    registry counts copies and other replicas' claims, tests/integration/cluster/
    test_registry_demand.py), and a target met everywhere costs no claim at all."""

    class Holding(FakeEngine):
        gpu: tuple[str, ...] = ()

        def stats(self) -> EngineStats:
            keys = tuple(ref(n).key for n in self.gpu)
            return EngineStats(keys, keys, (), 3 - len(keys), 3, 0, 0, 0.0, 0, 0, 0)

    reg = FakeRegistry(state(1, warm=("w1", "w2", "w3")))
    reg.full = {"w2"}
    engine = Holding(refuse=set(), held=set())
    pub = publisher(reg, engine)
    asyncio.run(pub.desired.follow(1))
    assert reg.claims == [["w1", "w2", "w3"]]
    assert engine.calls == [("load", "w1"), ("load", "w3")]
    engine.gpu = ("w1", "w3")
    asyncio.run(pub.desired.follow(1))  # same version: the targets are checked again
    assert reg.claims[-1] == ["w2"] and engine.calls[2:] == []
    engine.gpu = ("w1", "w2", "w3")
    asyncio.run(pub.desired.follow(1))
    assert len(reg.claims) == 2  # every target held here: no round trip


def test_each_failure_logged_once_per_version(caplog):
    engine = FakeEngine(refuse={"b"}, held=set())
    reg = FakeRegistry(state(4, pins=("b",)))
    pub = publisher(reg, engine)
    with caplog.at_level(logging.WARNING, logger="lorafleet.replica"):
        for version in (4, 4, 4, 5, 5):
            reg.state = state(version, pins=("b",))
            asyncio.run(pub.desired.follow(1))
    assert [r.getMessage() for r in caplog.records] == [
        f"desired state {v} not applied yet: pin 'b': pinning 'b' would pin every one of "
        "the 2 GPU slots"
        for v in (4, 5)
    ]


def test_a_registry_outage_fails_the_tick_instead_of_counting_as_a_refusal():
    outage = RegistryUnavailable("cannot reach Redis at redis://x")
    reg = FakeRegistry(state(2, warm=("w",)), claim_error=outage)
    pub = publisher(reg, FakeEngine(refuse=set(), held=set()))
    with pytest.raises(RegistryUnavailable):
        asyncio.run(pub.desired.follow(1))


def test_attempt_records_refusals_and_passes_other_errors():
    async def ok() -> None:
        pass

    async def refused() -> None:
        raise AdapterNotFound("x")

    async def broken() -> None:
        raise OSError("disk")

    failures: list[str] = []
    assert asyncio.run(attempt(failures, "load 'x'", ok())) is True
    assert asyncio.run(attempt(failures, "load 'x'", refused())) is False
    assert failures == ["load 'x': adapter 'x' not found"]
    with pytest.raises(OSError):
        asyncio.run(attempt(failures, "load 'x'", broken()))


def test_once_per_version():
    seen = OncePerVersion()
    assert seen.fresh(3, ["x"]) == ["x"]
    assert seen.fresh(3, ["x", "y", "y"]) == ["y"]
    assert seen.fresh(3, ["x", "y"]) == []
    assert seen.fresh(4, ["x"]) == ["x"]
    assert seen.fresh(3, ["x"]) == ["x"]  # any change of version starts over


@pytest.mark.parametrize("reap_every", [0, -1])
def test_reap_every_validated(reap_every: int):
    with pytest.raises(ValueError, match=f"reap_every={reap_every}; allowed: >= 1"):
        PublisherConfig("r1", "d", reap_every=reap_every)


@pytest.mark.parametrize("claim_s", [0.0, 0.001, 4000.0])
def test_warm_claim_s_validated(claim_s: float):
    with pytest.raises(ValueError, match=f"warm_claim_s={claim_s}; allowed: 0.01 .. 3600"):
        PublisherConfig("r1", "d", warm_claim_s=claim_s)


@pytest.mark.parametrize("still_draining", [False, True])
def test_a_drained_adapter_that_came_back_is_unloaded_again(still_draining: bool):
    """A request resolved just before the unregister reached the replica after the drain
    and loaded the adapter again: the next tick unloads it (once the desired state was
    applied, nothing else would). One still draining (its requests running) is left be."""
    gone = ref("gone")

    class Holding(FakeEngine):
        def stats(self) -> EngineStats:
            draining = (gone.key,) if still_draining else ()
            return EngineStats((gone.key,), (gone.key,), (), 1, 2, 1, 0, 0.0, 0, 0, 1, draining)

    engine = Holding(refuse=set(), held={"gone"})
    pub = publisher(FakeRegistry(state(5, draining=("gone",))), engine)
    pub.refs[gone.key] = gone
    pub.desired.version = 5  # its unload was applied before the request came back
    asyncio.run(pub.desired.follow(1))
    assert engine.calls == ([] if still_draining else [("unload", "gone")])
