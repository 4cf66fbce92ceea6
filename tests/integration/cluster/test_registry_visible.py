"""visible_adapters: what `/v1/models` lists, in one script, equal to the slow path
(list_adapters, then one authorize per adapter the tenant neither owns nor sees public)."""

from __future__ import annotations

import pytest

from cluster.registry import Registry


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
