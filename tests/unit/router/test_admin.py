"""The admin endpoints' registry refusals name the body field at fault, and unpin says
whether the adapter was pinned (fake registry raising and answering what the real one
does; tests/integration/serve/test_request_validation.py runs the real one)."""

import asyncio
import os
from dataclasses import dataclass

import pytest

from cluster.records import ServedBase
from lora_core.base_shape import BaseShape
from lora_core.errors import (
    AdapterAlreadyExists,
    AdapterIncompatible,
    AdapterLoadFailed,
    AdapterNotFound,
    InvalidRequest,
    LoraFleetError,
)
from router.admin import load_adapter, name_at_fault, unpin_adapter
from router.admin_bodies import LoadAdapterRequest
from router.body_parse import parse_body
from router.errors import openai_error_body, status_for

SHAPE = BaseShape("LlamaForCausalLM", num_layers=2, hidden=64, num_heads=4,
                  num_kv_heads=2, head_dim=16, intermediate=128)  # fmt: skip
SERVED = ServedBase("base", SHAPE, max_lora_rank=8)


@dataclass
class Rec:
    name: str
    version: int
    content_hash: str


class FakeCatalog:
    """Tenant acme exists; register_adapter raises `error` (if any) like the registry."""

    def __init__(self, error: LoraFleetError | None = None):
        self.error = error
        self.tenant_lookups = 0
        self.registrations = 0
        self.paths: list[str] = []

    async def register_adapter(self, name, path, **fields):
        self.registrations += 1
        self.paths.append(path)
        if self.error is not None:
            raise self.error
        return Rec(name, 3, "ab" * 32)

    async def list_tenants(self):
        self.tenant_lookups += 1
        return ["acme"]


def load(error: LoraFleetError | None, **fields) -> dict:
    body = parse_body(LoadAdapterRequest, {"lora_name": "a1", "lora_path": "/x", **fields})
    return asyncio.run(load_adapter(FakeCatalog(error), SERVED, body))


def refusal(error: LoraFleetError, **fields) -> tuple[int, dict]:
    with pytest.raises(LoraFleetError) as e:
        load(error, **fields)
    return status_for(e.value).http, openai_error_body(e.value)["error"]


NO_TENANT = InvalidRequest(
    "tenant 'ghost' does not exist; allowed: a tenant that `tenants list` shows (`tenants create` makes one)"
)


def test_an_unknown_tenant_is_named_with_how_to_create_one():
    assert refusal(NO_TENANT, tenant="ghost") == (400, {
        "message": "tenant 'ghost' does not exist; allowed: an existing tenant (create one "
        "with `lorafleet tenants create ghost`), or leave tenant out (no owner)",
        "type": "invalid_request_error", "param": "tenant", "code": "invalid_request",
    })  # fmt: skip


def test_an_invalid_request_not_about_the_tenant_is_left_as_it_is():
    other = InvalidRequest("something else")
    assert refusal(other, tenant="acme")[1]["message"] == "something else"
    assert refusal(other, tenant="acme")[1]["param"] is None


def test_the_base_model_id_as_name_names_lora_name():
    taken = InvalidRequest("adapter name 'base' is the base model's id; allowed: any other name")
    status, err = refusal(taken, lora_name="base", tenant="ghost")
    assert (status, err["param"], err["message"]) == (400, "lora_name", str(taken))


@pytest.mark.parametrize(
    "error, status, param",
    [
        (AdapterLoadFailed("path='/x' does not exist; allowed: an existing directory"), 422,
         "lora_path"),
        (AdapterIncompatible("r", "r=128 is above max_lora_rank", "r <= 8"), 400, "lora_path"),
        (AdapterIncompatible("base_model", "'other' is not served", "'base'"), 400,
         "base_model"),
        (AdapterAlreadyExists("adapter 'a1' already exists (version 1); allowed: pass replace"),
         409, "replace"),
    ],
)  # fmt: skip
def test_registry_refusals_name_the_field_at_fault(error, status, param):
    assert refusal(error) == (status, {**openai_error_body(error)["error"], "param": param})


def test_a_registration_answers_its_identity():
    assert load(None, tenant="acme") == {"lora_name": "a1", "version": 3, "content_hash": "ab" * 32}


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"lora_name": "bad name!"}, "lora_name", "lora_name: adapter name 'bad name!' is invalid"),
        ({"lora_name": ""}, "lora_name", "lora_name: adapter name '' is invalid"),
        ({"tenant": "a b"}, "tenant", "tenant: tenant name 'a b' is invalid"),
        (
            {"lora_path": ""},
            "lora_path",
            "lora_path: got an empty string; allowed: a string of at least 1 character",
        ),
        (
            {"lora_path": "/a\x00b"},
            "lora_path",
            "lora_path: contains a NUL character at index 2; allowed: an absolute path to a "
            "local directory",
        ),
        ({"base_model": 1}, "base_model", "base_model: got a number (1); allowed: a string"),
        ({"public": "yes"}, "public", "public: got a string; allowed: true or false"),
        ({"replace": 1}, "replace", "replace: got a number (1); allowed: true or false"),
    ],
)
def test_bad_fields_are_refused_when_the_body_is_parsed(fields, param, message):
    with pytest.raises(InvalidRequest) as e:
        parse_body(LoadAdapterRequest, {"lora_name": "a1", "lora_path": "/x", **fields})
    assert e.value.param == param and str(e.value).startswith(message)
    if param in ("lora_name", "tenant"):
        assert str(e.value).endswith(
            "allowed: 1-128 characters of letters, digits, '_', '.', '-', '/'"
        )


@pytest.mark.parametrize("path", ["adapters/a1", ".", "../../srv/a1", "~/a1", "~root/a1"])
def test_a_relative_path_is_refused_before_the_registry_is_asked(path):
    # The ingress would resolve it against its own working directory or home, which the
    # caller neither knows nor controls (docs/api.md: "a relative path" is a 422).
    catalog = FakeCatalog()
    body = parse_body(LoadAdapterRequest, {"lora_name": "a1", "lora_path": path})
    with pytest.raises(AdapterLoadFailed) as e:
        asyncio.run(load_adapter(catalog, SERVED, body))
    assert (status_for(e.value).http, e.value.param) == (422, "lora_path")
    assert str(e.value) == (
        f"lora_path={path!r} is relative; allowed: an absolute path to a local directory "
        "holding adapter_config.json and adapter_model.safetensors (relative paths and '~' "
        "would be resolved on the ingress, not where the request was written)"
    )
    assert catalog.registrations == 0


def test_adapter_roots_bound_where_the_endpoint_registers_from(tmp_path):
    """With adapter_roots the real path (symlinks resolved) must lie inside a root: a
    sibling directory sharing the root's name as a prefix, a '..' escape and a symlink
    planted inside the root that points out are all refused (422, lora_path), before the
    registry is asked."""
    root, outside = tmp_path / "adapters", tmp_path / "adapters-old"
    (root / "a1").mkdir(parents=True)
    (outside / "a1").mkdir(parents=True)
    (root / "link").symlink_to(outside / "a1")
    roots = (str(root),)

    def attempt(path) -> FakeCatalog:
        catalog = FakeCatalog()
        body = parse_body(LoadAdapterRequest, {"lora_name": "a1", "lora_path": str(path)})
        asyncio.run(load_adapter(catalog, SERVED, body, roots))
        return catalog

    assert attempt(root / "a1").registrations == 1
    assert attempt(f"{root}/x/../a1").registrations == 1
    assert attempt(f"{root}/x/../a1").paths == [os.path.realpath(root / "a1")]  # as checked
    for path in (outside / "a1", f"{root}/../adapters-old/a1", root / "link"):
        with pytest.raises(AdapterLoadFailed) as e:
            attempt(path)
        assert (status_for(e.value).http, e.value.param) == (422, "lora_path")
        assert str(e.value) == (
            f"lora_path={str(path)!r} is outside the adapter roots; allowed: a directory "
            f"under {root} (symlinks resolved: the cluster's adapter_roots)"
        )


class FakePins:
    """Like the registry's unpin: True if name was pinned, AdapterNotFound if unknown."""

    def __init__(self, pinned: set[str], known: set[str]):
        self.pinned, self.known = pinned, known

    async def unpin(self, name):
        if name not in self.known:
            raise AdapterNotFound(name)
        was = name in self.pinned
        self.pinned.discard(name)
        return was


def test_unpin_answers_whether_the_adapter_was_pinned():
    pins = FakePins({"a1"}, {"a1", "a2"})
    first = asyncio.run(unpin_adapter(pins, "a1"))
    assert first == {"lora_name": "a1", "pinned": False, "was_pinned": True}
    again = asyncio.run(unpin_adapter(pins, "a1"))
    assert again == {"lora_name": "a1", "pinned": False, "was_pinned": False}
    assert asyncio.run(unpin_adapter(pins, "a2"))["was_pinned"] is False


class RayWrapped(Exception):
    """Like Ray's RayTaskError: the original error is its `cause`."""

    def __init__(self, cause):
        super().__init__("traceback text")
        self.cause = cause


def test_an_unknown_adapter_on_an_admin_endpoint_names_lora_name():
    with pytest.raises(AdapterNotFound) as e:
        asyncio.run(unpin_adapter(FakePins(set(), set()), "ghost"))
    for err in (e.value, RayWrapped(e.value)):
        body = openai_error_body(name_at_fault(err))["error"]
        assert body == {"message": "adapter 'ghost' not found", "type": "invalid_request_error",
                        "param": "lora_name", "code": "model_not_found"}  # fmt: skip
    other = InvalidRequest("replicas=-1; allowed: 0 .. 100000", "replicas")
    assert name_at_fault(other) is other and other.param == "replicas"
