"""visible_adapters: what `/v1/models` lists, in one script, equal to the slow path
(list_adapters, then one authorize per adapter the tenant neither owns nor sees public)."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import redis

from cluster.registry import LIST_PAGE, AsyncRegistry, Registry
from cluster.scripts import SCRIPTS
from router.auth import AdapterResolver


@pytest.fixture
def catalog(registry: Registry, adapters) -> Registry:
    """t1 owns a1 (and d, draining); a2 is public; t2 is granted a3 (owned by t1)."""
    for tenant in ("t1", "t2", "t3"):
        registry.create_tenant(tenant)
    registry.register_adapter("a1", str(adapters["a"]), tenant="t1")
    registry.register_adapter("a2", str(adapters["b"]), public=True)
    registry.register_adapter("a3", str(adapters["small"]), tenant="t1")
    registry.register_adapter("d", str(adapters["a"]), tenant="t1", public=True)
    registry.grant("t2", "a3")
    epoch = registry.register_replica("r1", "mixed", "dep", 4, 30.0)
    registry.report_resident("r1", epoch, ("d", 1), "gpu")
    assert registry.unregister_adapter("d") == "draining"
    return registry


def _slow_path(reg: Registry, tenant: str | None) -> list[str]:
    return [
        a.record.name
        for a in reg.list_adapters()
        if a.record.state == "active"
        and (tenant is None or a.record.public or a.record.owner == tenant
             or reg.authorize(tenant, a.record.name))
    ]  # fmt: skip


@pytest.mark.parametrize(
    "tenant, names",
    [(None, ["a1", "a2", "a3"]), ("t1", ["a1", "a2", "a3"]), ("t2", ["a2", "a3"]),
     ("t3", ["a2"]), ("nobody", ["a2"])],
)  # fmt: skip
def test_visible_adapters_per_tenant(catalog: Registry, tenant, names):
    refs = catalog.visible_adapters(tenant)
    assert [r.name for r in refs] == names == _slow_path(catalog, tenant)
    assert refs == [catalog.get_adapter(n).ref for n in names]


def test_visible_adapters_by_page(catalog: Registry):
    assert [r.name for r in catalog.visible_adapters("t2", ["a3", "zzz", "a1", "d"])] == ["a3"]
    assert catalog.visible_adapters("t2", []) == []
    # a replace is visible at once as the new version
    new = catalog.register_adapter("a3", catalog.get_adapter("a1").path, replace=True)
    assert catalog.visible_adapters("t2", ["a3"]) == [new.ref]


def _catalog_of(redis_url: str, names: list[str]) -> None:
    """Records of names (every third public, the rest owned by t1) written as
    register_adapter stores them, without validating len(names) adapter directories."""
    client = redis.Redis.from_url(redis_url)
    pipe = client.pipeline()
    pipe.hset("t:tenant:t1", mapping={"name": "t1", "created": 1})
    pipe.sadd("t:tenants", "t1")
    for i, name in enumerate(names):
        fields = dict(name=name, version=1, content_hash="ab" * 32, path=f"/a/{name}", rank=8,
                      base_model="m", target_modules='["q_proj"]', owner="t1" if i % 3 else "",
                      public="1" if i % 3 == 0 else "0", created=1, state="active")  # fmt: skip
        pipe.hset(f"t:adapter:{name}", mapping=fields)
        pipe.sadd("t:adapters", name)
    pipe.execute()
    client.close()


@pytest.mark.parametrize("tenant", [None, "t1", "t2"])
def test_models_listing_pages_the_catalog(registry: Registry, redis_url, tenant):
    # `/v1/models` (any caller with a key, or anyone with auth off) ran one script over
    # the whole catalog: with 10k adapters it held Redis ~50 ms per call, so a client
    # listing in a loop stalled every request's resolution on every ingress.
    names = [f"m{i:04d}" for i in range(2 * LIST_PAGE + 10)]
    _catalog_of(redis_url, names)
    keys = {t: registry.issue_api_key(t) for t in ("t1",)}
    if tenant == "t2":
        registry.create_tenant("t2")
        keys["t2"] = registry.issue_api_key("t2")
    client = redis.Redis.from_url(redis_url)
    client.config_set("slowlog-max-len", 10000)
    client.config_set("slowlog-log-slower-than", 0)
    client.slowlog_reset()

    async def models() -> list:
        reg = AsyncRegistry(redis_url, namespace="t")
        try:
            resolver = AdapterResolver(reg, "base", auth=tenant is not None, admin_key="")
            return await resolver.visible_adapters(keys.get(tenant))
        finally:
            await reg.close()

    try:
        refs = asyncio.run(models())
        log = client.slowlog_get(10000)
    finally:
        client.config_set("slowlog-log-slower-than", 10000)
        client.close()
    assert refs == registry.visible_adapters(tenant)
    assert len(refs) == (len(names) if tenant in (None, "t1") else len(names[::3]))
    sha = hashlib.sha1(SCRIPTS["visible_adapters"].encode()).hexdigest().encode()
    calls = [e["command"].split() for e in log if e["command"].split()[1:2] == [sha]]
    assert all(b"all" not in c for c in calls)  # no script over the whole catalog
    pages = sorted(c[c.index(b"names") + 1] for c in calls)  # each page's first name
    assert pages == [n.encode() for n in names[::LIST_PAGE]]
