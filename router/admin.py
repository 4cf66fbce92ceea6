"""The admin endpoints' work on the registry (Ray-free; ingress.py wires the routes).

The registry refuses a registration knowing names and paths, not the request body; here
each refusal is tied to the body field at fault, so the OpenAI error JSON's `param`
names it and the message says what is allowed.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Protocol

from cluster.catalog import base_model_note
from lora_core.aio import raise_if_cancelled
from lora_core.errors import (
    AdapterAlreadyExists,
    AdapterIncompatible,
    AdapterLoadFailed,
    AdapterNotFound,
    InvalidRequest,
    LoraFleetError,
)
from router.admin_bodies import LoadAdapterRequest
from router.errors import unwrap

if TYPE_CHECKING:
    from cluster.records import AdapterRecord, ServedBase

SERVED_REPUBLISH_S = 10.0
log = logging.getLogger("lorafleet.router")


class ServedPublisher(Protocol):
    async def publish_served(self, served: ServedBase) -> None: ...


async def publish_served(registry: ServedPublisher, served: ServedBase) -> None:
    """Publish the served base model, refusing to serve over an adapter of its id
    (AdapterAlreadyExists, naming both ways out; nothing is published).

    Registration refuses the served base model's id as an adapter name, but only once a
    cluster published it: an adapter registered under that id before the first start
    would be shadowed (requests naming it resolve to the base model, a silent fallback),
    so the ingress does not start until the operator renames one of them. The check and
    the write are one registry script, as registration's check and write are, so an
    ingress starting while `adapters register` runs (or two ingresses) never leave both.
    """
    await registry.publish_served(served)


async def keep_served_published(
    registry: ServedPublisher, served: ServedBase, every_s: float = SERVED_REPUBLISH_S
) -> None:
    """Publish the served base model again every every_s: a Redis that restarted empty
    (or was flushed) would otherwise lose it until the ingress restarts, and meanwhile
    `adapters register` skips its shape and rank checks and pins skip the slot check.
    Errors are logged and retried: the registry may be down for a while. An adapter
    registered under the base model's id while the record was gone is logged as an
    error each round (requests naming it get the base model until it is unregistered)."""
    while True:
        raise_if_cancelled()
        await asyncio.sleep(every_s)
        try:
            await publish_served(registry, served)
        except AdapterAlreadyExists as e:
            log.error("%s", e)
        except Exception as e:  # an outage: the next round tries again
            log.debug("publishing the served base model failed: %s", e)


class CatalogRegistry(Protocol):
    """The registry calls registration makes (`cluster.registry.AsyncRegistry`)."""

    async def register_adapter(
        self,
        name: str,
        path: str,
        *,
        base_model: str | None,
        tenant: str | None,
        public: bool | None,
        replace: bool,
        served: ServedBase,
    ) -> AdapterRecord: ...

    async def list_tenants(self) -> list[str]: ...


class PinRegistry(Protocol):
    async def unpin(self, name: str) -> bool: ...


async def unpin_adapter(registry: PinRegistry, name: str) -> dict[str, str | bool]:
    """POST /v1/unpin_lora_adapter: name is unpinned now (`pinned` false); `was_pinned`
    says whether it was pinned before (the CLI's "(was not pinned)")."""
    was_pinned = await registry.unpin(name)
    return {"lora_name": name, "pinned": False, "was_pinned": was_pinned}


def name_at_fault(err: BaseException) -> BaseException:
    """err (unwrapped), an unknown adapter naming `lora_name` as its `param`: every admin
    body names its adapter there, as the load endpoint's refusals name their field."""
    err = unwrap(err)
    if isinstance(err, AdapterNotFound) and err.param is None:
        err.param = "lora_name"
    return err


def no_tenant(tenant: str) -> InvalidRequest:
    return InvalidRequest(
        f"tenant {tenant!r} does not exist; allowed: an existing tenant (create one with "
        f"`lorafleet tenants create {tenant}`), or leave tenant out (no owner)",
        "tenant",
    )


async def load_adapter(
    registry: CatalogRegistry,
    served: ServedBase,
    req: LoadAdapterRequest,
    roots: tuple[str, ...] = (),
) -> dict[str, str | int]:
    """POST /v1/load_lora_adapter: validate and register req's adapter as its name's next
    version. Errors are the registry's, each naming the body field at fault. roots: see
    `check_adapter_path`."""
    path = check_adapter_path(req.lora_path, roots)
    try:
        rec = await registry.register_adapter(
            req.lora_name,
            path,
            base_model=req.base_model,
            tenant=req.tenant,
            public=req.public,
            replace=req.replace,
            served=served,
        )
    except LoraFleetError as e:
        raise await _at_fault(registry, served, req, e) from None
    out: dict[str, str | int] = {
        "lora_name": rec.name,
        "version": rec.version,
        "content_hash": rec.content_hash,
    }
    if req.base_model is None:  # an explicit base_model was checked against the served one
        warning = await asyncio.to_thread(base_model_note, path, served.model_id)
        if warning is not None:
            out["warning"] = warning
    return out


def check_adapter_path(path: str, roots: tuple[str, ...]) -> str:
    """The path to register: path itself, or with roots its real path (symlinks
    resolved), which must lie inside the real path of one of them; else AdapterLoadFailed
    (param lora_path). Registering the real path keeps a symlink swapped inside a root
    after the check from pointing the replicas elsewhere.

    Relative paths and '~' would be resolved against the ingress's working directory and
    home, which the caller neither knows nor controls (the CLI may take them: they are
    the caller's own). Roots keep the admin endpoint from reading directories elsewhere
    on the ingress's host, also through a symlink planted inside a root.
    Example: roots ("/srv/adapters",): "/srv/adapters/a" passes, "/srv/adapters/../etc"
    and "/srv/adapters-old/a" do not."""
    if not os.path.isabs(path):
        raise _path_refused(
            f"lora_path={path!r} is relative; allowed: an absolute path to a local directory "
            "holding adapter_config.json and adapter_model.safetensors (relative paths and "
            "'~' would be resolved on the ingress, not where the request was written)"
        )
    if not roots:
        return path
    real = os.path.realpath(path)
    for root in roots:
        top = os.path.realpath(root)
        if os.path.commonpath([real, top]) == top:
            return real
    raise _path_refused(
        f"lora_path={path!r} is outside the adapter roots; allowed: a directory under "
        f"{', '.join(roots)} (symlinks resolved: the cluster's adapter_roots)"
    )


def _path_refused(message: str) -> AdapterLoadFailed:
    err = AdapterLoadFailed(message)
    err.param = "lora_path"
    return err


async def _at_fault(
    registry: CatalogRegistry, served: ServedBase, req: LoadAdapterRequest, err: LoraFleetError
) -> LoraFleetError:
    """err with `param` set to the field at fault (the names' syntax was checked when the
    body was parsed; what is left is what only the registry knows)."""
    if isinstance(err, AdapterIncompatible):
        err.param = "base_model" if err.field == "base_model" else "lora_path"
    elif isinstance(err, AdapterLoadFailed):
        err.param = "lora_path"
    elif isinstance(err, AdapterAlreadyExists):
        err.param = "replace"
    elif isinstance(err, InvalidRequest) and err.param is None:
        if req.lora_name == served.model_id:
            err.param = "lora_name"
        elif req.tenant is not None and req.tenant not in await registry.list_tenants():
            return no_tenant(req.tenant)
    return err
