"""RegistryPublishers over stand-in engines, for the publisher tests against a real Redis.

The engine exposes only what the publisher reads (stats) and calls (load/pin/unpin/
unload), so each test sets residency exactly. Like the real slot pool it has 2 GPU
slots and refuses a pin that would leave none evictable.
"""

from __future__ import annotations

from cluster.client import RetryPolicy
from cluster.registry import AsyncRegistry, Registry
from lora_core.errors import AdapterNotFound, PinRefused
from lora_core.identity import AdapterRef
from replica.outputs import EngineStats
from replica.serve_registry import PublisherConfig, RegistryPublisher

FAST = RetryPolicy(retries=0, connect_timeout_s=0.2, socket_timeout_s=0.5)
SLOTS = 2


class StubEngine:
    """Holds the keys in gpu / cpu; GPU loads land at once; refuses the last slot's pin."""

    def __init__(self):
        self.gpu: list[str] = []
        self.cpu: list[str] = []
        self.pinned: list[str] = []
        self.calls: list[tuple] = []

    def stats(self) -> EngineStats:
        free = max(0, SLOTS - len(self.gpu))
        return EngineStats(tuple(self.gpu), tuple(self.cpu), (), free, SLOTS, 0, 0, 0.0, 0, 0, 0)

    async def load_adapter(self, ref, to_gpu=False):
        self.calls.append(("load", ref.name, to_gpu))
        if to_gpu and ref.key not in self.gpu:
            self.gpu.append(ref.key)

    def pin(self, ref):
        if len(self.pinned) + 1 >= SLOTS:
            self.calls.append(("pin refused", ref.name))
            raise PinRefused(f"pinning {ref.key!r} would pin every one of the {SLOTS} slots")
        self.calls.append(("pin", ref.name))
        self.pinned.append(ref.name)

    def unpin(self, name):
        self.calls.append(("unpin", name))
        if name in self.pinned:
            self.pinned.remove(name)

    async def unload_adapter(self, name):
        self.calls.append(("unload", name))
        held = [k for k in self.gpu + self.cpu if k.startswith(f"{name}@")]
        if not held:
            raise AdapterNotFound(name)
        self.gpu = [k for k in self.gpu if k not in held]
        self.cpu = [k for k in self.cpu if k not in held]


def register(url, demo, names=("demo-poet", "demo-chef")) -> dict[str, AdapterRef]:
    """Register names (demo adapters, or others that reuse demo-poet's files), public."""
    reg = Registry(url)
    try:
        return {
            n: reg.register_adapter(
                n, str(demo.adapters.get(n, demo.adapters["demo-poet"])), public=True
            ).ref
            for n in names
        }
    finally:
        reg.close()


def publisher(
    url, refs, replica="rep1", reap_every=10, prefetch=True
) -> tuple[StubEngine, RegistryPublisher]:
    """A publisher for replica over a fresh StubEngine, knowing refs."""
    engine = StubEngine()
    config = PublisherConfig(
        replica,
        "LoraReplica",
        tick_s=0.05,
        lease_ttl_s=2.0,  # a tick stalled by a loaded machine for ~1 s must not lapse it
        reap_every=reap_every,
        prefetch=prefetch,
    )
    pub = RegistryPublisher(config, AsyncRegistry(url, retry=FAST), engine, {})
    for ref in refs.values():
        pub.refs[ref.key] = ref
    return engine, pub


def setup(url, demo, names=("demo-poet", "demo-chef"), replica="rep1", reap_every=10):
    """register(names), then a publisher for replica knowing them."""
    refs = register(url, demo, names)
    engine, pub = publisher(url, refs, replica, reap_every)
    return engine, pub, refs


def locations(url, name):
    reg = Registry(url)
    try:
        return [(loc.replica, loc.tier) for loc in reg.locations(name)]
    finally:
        reg.close()
