"""Publishing the served base model and registering an adapter under its id exclude each
other atomically (real Redis): whatever the interleaving, never both, so no adapter is
left shadowed by the base model (its requests answered by the base: a silent fallback)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from cluster.records import AdapterRecord, ServedBase
from cluster.registry import AsyncRegistry, Registry
from lora_core.base_shape import BaseShape
from lora_core.errors import AdapterAlreadyExists, AdapterNotFound, InvalidRequest
from tests.redis_fixture import dump_redis

SHAPE = BaseShape("LlamaForCausalLM", num_layers=2, hidden=64, num_heads=4,
                  num_kv_heads=2, head_dim=16, intermediate=128)  # fmt: skip
SERVED = ServedBase("tiny", SHAPE, max_lora_rank=16, max_loras=2)
ROUNDS = 40


def _both(reg: Registry) -> tuple[bool, bool]:
    """(an adapter record holds the served id, the served record is published)."""
    try:
        reg.get_adapter(SERVED.model_id)
        adapter = True
    except AdapterNotFound:
        adapter = False
    return adapter, reg.get_served() is not None


def test_a_registration_validated_before_the_cluster_started_is_refused(
    registry: Registry, adapters: dict[str, Path], redis_url
):
    """`adapters register` reads no served record (no cluster yet) and validates the
    directory; a cluster publishes its base under the same id meanwhile: the write is
    refused in the script, naming the id, and leaves Redis as it was."""
    registry.publish_served(SERVED)
    before = dump_redis(redis_url)
    with pytest.raises(InvalidRequest, match="'tiny' is the base model's id"):
        registry.register_adapter("tiny", str(adapters["a"]))  # served=None: read before
    with pytest.raises(InvalidRequest, match="base model's id"):
        registry.register_adapter("tiny", str(adapters["a"]), replace=True)
    assert dump_redis(redis_url) == before
    assert _both(registry) == (False, True)
    registry.register_adapter("other", str(adapters["a"]))  # other names still register


def test_publish_refuses_an_adapter_of_its_id_active_or_draining(
    registry: Registry, adapters: dict[str, Path], redis_url
):
    registry.register_adapter("tiny", str(adapters["a"]))
    with pytest.raises(AdapterAlreadyExists, match="lorafleet adapters unregister tiny"):
        registry.publish_served(SERVED)
    epoch = registry.register_replica("r1", "mixed", "d", 4, 30.0)
    registry.report_resident("r1", epoch, registry.get_adapter("tiny").ref, "gpu")
    assert registry.unregister_adapter("tiny") == "draining"
    before = dump_redis(redis_url)
    with pytest.raises(AdapterAlreadyExists, match=r"registered \(draining\).*wait until"):
        registry.publish_served(SERVED)
    assert dump_redis(redis_url) == before
    registry.remove_resident("r1", epoch, "tiny")  # the last copy goes: the record too
    registry.publish_served(SERVED)
    assert _both(registry) == (False, True)


def _race(registry: Registry, path: str) -> list[Exception]:
    """Register an adapter under the served id and publish the served base at once
    (two threads released together); the errors they raised."""
    start = threading.Barrier(2)
    errors: list[Exception] = []

    def register() -> None:
        start.wait()
        try:
            registry.register_adapter(SERVED.model_id, path)
        except InvalidRequest as e:
            errors.append(e)

    def publish() -> None:
        start.wait()
        try:
            registry.publish_served(SERVED)
        except AdapterAlreadyExists as e:
            errors.append(e)

    threads = [threading.Thread(target=f) for f in (register, publish)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_concurrent_register_and_publish_never_leave_both(
    registry: Registry, adapters: dict[str, Path]
):
    """Each round: one thread registers an adapter under the served id (as the CLI does
    before any cluster started: no served record read), another publishes the served
    base (as an ingress starting does); exactly one of them wins."""
    for _ in range(ROUNDS):
        registry.client.flushall()
        errors = _race(registry, str(adapters["a"]))
        assert _both(registry) in ((True, False), (False, True))
        assert len(errors) == 1, errors


def test_two_ingresses_publishing_while_a_registration_runs(redis_url, adapters):
    """asyncio: two ingresses publish at once while the same id is registered; never
    both, and each call that lost says why."""

    async def scenario() -> None:
        regs = [AsyncRegistry(redis_url, namespace="t") for _ in range(3)]
        results = await asyncio.gather(
            regs[0].register_adapter("tiny", str(adapters["a"])),
            regs[1].publish_served(SERVED),
            regs[2].publish_served(SERVED),
            return_exceptions=True,
        )
        for reg in regs:
            await reg.close()
        assert isinstance(results[0], AdapterRecord | InvalidRequest), results[0]
        assert all(r is None or isinstance(r, AdapterAlreadyExists) for r in results[1:])

    sync = Registry(redis_url, namespace="t")
    for _ in range(ROUNDS // 4):
        sync.client.flushall()
        asyncio.run(scenario())
        assert _both(sync) in ((True, False), (False, True))
    sync.close()
