"""Adapter catalog against a real redis-server: register, replace, refuse, unregister."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.records import ServedBase
from cluster.registry import Registry
from lora_core.base_shape import BaseShape
from lora_core.errors import (
    AdapterAlreadyExists,
    AdapterDraining,
    AdapterIncompatible,
    AdapterLoadFailed,
    AdapterNotFound,
    InvalidRequest,
)
from lora_core.validate import content_hash, validate_adapter_dir
from tests.redis_fixture import dump_redis


def test_register_stores_validated_record(registry: Registry, adapters: dict[str, Path]):
    rec = registry.register_adapter("a", str(adapters["a"]), base_model="tiny-llama")
    assert rec.version == 1
    assert rec.content_hash == content_hash(adapters["a"])
    assert rec.path == str(adapters["a"].resolve())
    assert (rec.rank, rec.target_modules) == (8, ("q_proj", "v_proj"))
    assert (rec.base_model, rec.owner, rec.public, rec.state) == ("tiny-llama", "", False, "active")
    assert registry.get_adapter("a") == rec
    assert rec.ref.key == f"a@1:{rec.content_hash[:16]}"


def test_base_model_defaults_to_adapter_config(registry: Registry, adapters: dict[str, Path]):
    rec = registry.register_adapter("a", str(adapters["a"]))
    assert rec.base_model == validate_adapter_dir(adapters["a"], max_rank=16).base_model


def test_existing_name_refused_unless_replace(registry: Registry, adapters, redis_url):
    registry.register_adapter("a", str(adapters["a"]))
    before = dump_redis(redis_url)
    with pytest.raises(AdapterAlreadyExists, match=r"'a' already exists \(version 1\)"):
        registry.register_adapter("a", str(adapters["b"]))
    assert dump_redis(redis_url) == before
    rec = registry.register_adapter("a", str(adapters["b"]), replace=True)
    assert (rec.version, rec.content_hash) == (2, content_hash(adapters["b"]))
    assert registry.get_adapter("a").version == 2


@pytest.mark.parametrize(
    "kind,error,match",
    [
        ("dora", AdapterIncompatible, "use_dora"),
        ("bias", AdapterIncompatible, "bias"),
        ("modules_to_save", AdapterIncompatible, "modules_to_save"),
        ("missing_config", AdapterLoadFailed, "adapter_config.json"),
        ("missing_weights", AdapterLoadFailed, "adapter_model.safetensors"),
        ("corrupt_weights", AdapterLoadFailed, "adapter_model.safetensors"),
        ("pickle_weights", AdapterLoadFailed, "pickle"),
    ],
)
def test_invalid_dir_refused_and_redis_unchanged(
    registry: Registry, adapters, broken_adapters, redis_url, kind, error, match
):
    registry.register_adapter("a", str(adapters["a"]))
    registry.create_tenant("t1")
    before = dump_redis(redis_url)
    for replace in (False, True):
        with pytest.raises(error, match=match):
            registry.register_adapter("a", str(broken_adapters[kind]), replace=replace)
        with pytest.raises(error, match=match):
            registry.register_adapter("new", str(broken_adapters[kind]), tenant="t1")
    assert dump_redis(redis_url) == before


def test_rank_over_cluster_max_refused(redis_url, adapters):
    reg = Registry(redis_url, namespace="t", max_lora_rank=4)
    before = dump_redis(redis_url)
    with pytest.raises(AdapterIncompatible, match="rank"):
        reg.register_adapter("a", str(adapters["a"]))
    assert dump_redis(redis_url) == before
    assert reg.register_adapter("small", str(adapters["small"])).rank == 4
    reg.close()


def test_unknown_tenant_and_bad_names_refused(registry: Registry, adapters, redis_url):
    before = dump_redis(redis_url)
    with pytest.raises(InvalidRequest, match="tenant 'ghost' does not exist"):
        registry.register_adapter("a", str(adapters["a"]), tenant="ghost")
    with pytest.raises(ValueError, match="adapter name 'a:b' is invalid"):
        registry.register_adapter("a:b", str(adapters["a"]))
    with pytest.raises(AdapterLoadFailed, match="does not exist"):
        registry.register_adapter("a", "/nonexistent/dir")
    # "" would resolve to the working directory (an adapter directory when run inside one)
    for empty in ("", "  "):
        with pytest.raises(AdapterLoadFailed, match="^path is empty; allowed: an existing"):
            registry.register_adapter("a", empty)
    assert dump_redis(redis_url) == before


def test_list_and_show(registry: Registry, adapters):
    registry.register_adapter("b", str(adapters["b"]), public=True)
    registry.register_adapter("a", str(adapters["a"]))
    registry.pin("a", "decode")
    registry.warm("b", 3, "prefill")
    listing = registry.list_adapters()
    assert [x.record.name for x in listing] == ["a", "b"]
    assert [x.to_json()["pinned"] for x in listing] == [True, False]
    assert [x.to_json()["warm_replicas"] for x in listing] == [0, 3]
    assert registry.show_adapter("b").to_json()["public"] is True
    assert registry.list_adapter_names() == ["a", "b"]
    assert [x.record.name for x in registry.list_adapters(["b", "zzz", "a"])] == ["a", "b"]
    assert registry.list_adapters([]) == []
    with pytest.raises(AdapterNotFound):
        registry.show_adapter("zzz")
    with pytest.raises(AdapterNotFound):
        registry.get_adapter("zzz")


def test_unregister_without_residency_removes(registry: Registry, adapters):
    registry.register_adapter("a", str(adapters["a"]))
    registry.pin("a")
    assert registry.unregister_adapter("a") == "removed"
    with pytest.raises(AdapterNotFound):
        registry.get_adapter("a")
    assert registry.desired_state().pins == {}
    # versions are never reused, even after removal
    assert registry.register_adapter("a", str(adapters["a"])).version == 2
    with pytest.raises(AdapterNotFound):
        registry.unregister_adapter("zzz")


def test_unregister_drains_until_last_copy_removed(registry: Registry, adapters):
    registry.register_adapter("a", str(adapters["a"]))
    e1 = registry.register_replica("r1", "mixed", "d", 4, 5.0)
    e2 = registry.register_replica("r2", "decode", "d", 4, 5.0)
    registry.report_resident("r1", e1, ("a", 1), "gpu")
    registry.report_resident("r2", e2, ("a", 1), "cpu")
    assert registry.unregister_adapter("a") == "draining"
    assert registry.get_adapter("a").state == "draining"
    assert registry.desired_state().draining == frozenset({"a"})
    with pytest.raises(AdapterDraining):
        registry.resolve_request(None, "a", auth=False)
    assert registry.remove_resident("r1", e1, "a") is True
    assert registry.get_adapter("a").state == "draining"
    assert registry.remove_resident("r2", e2, ("a", 1)) is True
    with pytest.raises(AdapterNotFound):
        registry.get_adapter("a")
    assert registry.desired_state().draining == frozenset()


@pytest.mark.parametrize("replace", [True, False], ids=["replace", "no-replace"])
def test_registering_again_revives_draining_adapter(registry: Registry, adapters, replace):
    registry.register_adapter("a", str(adapters["a"]))
    e = registry.register_replica("r1", "mixed", "d", 4, 5.0)
    registry.report_resident("r1", e, ("a", 1), "gpu")
    assert registry.unregister_adapter("a") == "draining"
    # an unregistered name is free again: no replace needed while its old version drains
    rec = registry.register_adapter("a", str(adapters["b"]), replace=replace)
    assert (rec.version, registry.get_adapter("a").state) == (2, "active")
    assert registry.resolve_request(None, "a", auth=False).ref == rec.ref
    # the replica still holds version 1: not a location of version 2
    assert registry.locations("a") == ()


def _shape(hidden: int) -> BaseShape:
    return BaseShape("LlamaForCausalLM", num_layers=2, hidden=hidden, num_heads=4,
                     num_kv_heads=2, head_dim=hidden // 4, intermediate=128)  # fmt: skip


def test_base_shape_fit_checked_when_known(registry: Registry, adapters, redis_url):
    registry.set_base_shape("tiny", _shape(64))
    registry.set_base_shape("wide", _shape(128))
    assert registry.get_base_shape("tiny") == _shape(64)
    assert registry.get_base_shape("unknown") is None
    rec = registry.register_adapter("a", str(adapters["a"]), base_model="tiny",
                                    base=registry.get_base_shape("tiny"))  # fmt: skip
    assert rec.base_model == "tiny"
    before = dump_redis(redis_url)
    with pytest.raises(AdapterIncompatible):
        registry.register_adapter("w", str(adapters["a"]), base_model="wide",
                                  base=registry.get_base_shape("wide"))  # fmt: skip
    assert dump_redis(redis_url) == before


def test_served_base_round_trips(registry: Registry):
    assert registry.get_served() is None
    served = ServedBase("tiny", _shape(64), max_lora_rank=8)
    registry.set_served(served)
    assert registry.get_served() == served


@pytest.mark.parametrize(
    "name,path,kwargs,error,match",
    [
        ("tiny", "a", {}, InvalidRequest, "base model's id"),
        ("w", "a", {"shape": _shape(128)}, AdapterIncompatible, "do not fit the base model"),
        ("w", "a", {"max_lora_rank": 4}, AdapterIncompatible, "rank <= 4"),
        ("w", "a", {"base_model": "llama-7b"}, AdapterIncompatible, "not the model this cluster"),
    ],
)
def test_served_base_refusals(registry: Registry, adapters, redis_url, name, path, kwargs,
                              error, match):  # fmt: skip
    served = ServedBase("tiny", kwargs.get("shape", _shape(64)), kwargs.get("max_lora_rank", 16))
    before = dump_redis(redis_url)
    with pytest.raises(error, match=match):
        registry.register_adapter(name, str(adapters[path]), served=served,
                                  base_model=kwargs.get("base_model"))  # fmt: skip
    assert dump_redis(redis_url) == before


def test_served_base_is_recorded_as_the_adapters_base(registry: Registry, adapters):
    served = ServedBase("tiny", _shape(64), max_lora_rank=16)
    rec = registry.register_adapter("a", str(adapters["a"]), served=served)
    assert rec.base_model == "tiny"  # not the adapter config's base_model_name_or_path
    rec = registry.register_adapter("b", str(adapters["b"]), served=served, base_model="tiny")
    assert rec.base_model == "tiny"
