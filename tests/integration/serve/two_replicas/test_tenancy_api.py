"""Who may use what on the two-replica cluster: API keys and tenants over REST and gRPC,
bad input and unservable adapters as 4xx (never 500), the admin endpoints.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from cluster.records import key_id
from cluster.registry import hash_key
from router.proto import lorafleet_pb2 as pb
from tests.integration.serve.cluster_fixture import (
    ADMIN_KEY,
    misfit_adapters,
)
from tests.integration.serve.two_replicas.calls import PROMPT, client, complete

pytestmark = pytest.mark.integration


AUTH = [  # key, model, expected status
    (None, "demo-poet", 401),
    ("bad", "demo-poet", 401),
    ("t1", "demo-poet", 200),
    ("t1", "t1-private", 200),
    ("t2", "t1-private", 404),
    ("t1", "extra-0", 404),
    ("t2", "extra-0", 200),
    ("ops", "extra-0", 200),
    ("ops", "t1-private", 200),
    ("t1", "no-such-adapter", 404),
    ("t1", "BASE", 200),
    (None, "BASE", 401),
]


@pytest.mark.parametrize("key, model, status", AUTH)
def test_auth_matrix(cluster, key, model, status):
    headers = {}
    if key is not None:
        headers["Authorization"] = f"Bearer {cluster.keys.get(key, 'lf-not-a-key')}"
    model = cluster.base if model == "BASE" else model
    r = httpx.post(
        f"{cluster.http}/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0},
        headers=headers,
        timeout=60,
    )
    assert r.status_code == status, r.text
    if status != 200:
        err = r.json()["error"]
        assert err["type"] == {401: "authentication_error", 404: "invalid_request_error"}[status]
    if status == 404:
        assert r.json()["error"]["message"] == f"adapter {model!r} not found"


def test_models_lists_what_each_tenant_may_use(cluster):
    def ids(key):
        return [m.id for m in client(cluster, key).models.list()]

    public = ["demo-chef", "demo-coder", "demo-poet", "extra-1", "extra-2", "extra-3"]
    assert ids("t1") == [cluster.base, *sorted(public + ["t1-private"])]
    assert ids("t2") == [cluster.base, *sorted(public + ["extra-0"])]
    models = client(cluster, "t2").models.list().data
    assert {m.parent for m in models[1:]} == {cluster.base}


@pytest.mark.parametrize(
    "body",
    [
        {"model": "demo-poet", "prompt": PROMPT, "max_tokens": -1},
        {"model": "demo-poet", "prompt": PROMPT, "temperature": "hot"},
        {"model": "demo-poet", "prompt": [999999]},
        {"model": "demo-poet", "prompt": PROMPT, "max_tokens": 100000},
        {"prompt": PROMPT},
    ],
)
def test_bad_input_is_400_never_500(cluster, body):
    r = httpx.post(
        f"{cluster.http}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {cluster.keys['ops']}"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_adapters_that_cannot_serve_are_refused_not_500(cluster, tmp_path):
    reg = cluster.registry()
    assert reg.get_served().model_id == cluster.base  # the ingress published it
    names = reg.list_adapter_names()
    paths = misfit_adapters(cluster, tmp_path)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for name, path, code in [
        ("wide", paths["wide"], "adapter_incompatible"),
        ("nan", paths["nan"], "adapter_incompatible"),
        (cluster.base, str(cluster.adapters["extra-1"]), "invalid_request"),
    ]:
        body = {"lora_name": name, "lora_path": path, "public": True}
        r = httpx.post(f"{cluster.http}/v1/load_lora_adapter", json=body, headers=admin, timeout=30)
        assert (r.status_code, r.json()["error"]["code"]) == (400, code), r.text
    assert reg.list_adapter_names() == names
    # Registered past the check (a registry client that knows no base): the replica's own
    # validation refuses it, and its error reaches the client as the same 400, not a 500.
    reg.register_adapter("sneaky-wide", paths["wide"], public=True)
    with pytest.raises(openai.BadRequestError, match="do not fit the base model"):
        complete(cluster, "sneaky-wide")
    assert reg.unregister_adapter("sneaky-wide") in ("draining", "removed")
    reg.close()


def test_admin_endpoints(cluster, tmp_path):
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    path = str(cluster.adapters["extra-1"])
    body = {"lora_name": "late-tenant", "lora_path": path, "public": True}
    r = httpx.post(f"{cluster.http}/v1/load_lora_adapter", json=body, timeout=30)
    assert r.status_code == 401
    r = httpx.post(f"{cluster.http}/v1/load_lora_adapter", json=body, headers=admin, timeout=30)
    # its config names no other base model: no warning
    assert r.status_code == 200 and (r.json()["version"], r.json().get("warning")) == (1, None)
    assert (
        complete(cluster, "late-tenant").choices[0].text
        == complete(cluster, "extra-1").choices[0].text
    )
    r = httpx.post(
        f"{cluster.http}/v1/pin_lora_adapter", json={"lora_name": "late-tenant"}, headers=admin
    )
    assert r.status_code == 200
    reg = cluster.registry()
    assert reg.desired_state().pins == {"late-tenant": "all"}
    # max_loras 2: a second pin would leave the replicas no evictable slot
    r = httpx.post(
        f"{cluster.http}/v1/pin_lora_adapter", json={"lora_name": "extra-1"}, headers=admin
    )
    assert r.status_code == 409 and r.json()["error"]["code"] == "pin_refused", r.text
    assert "2 slots (max_loras) and 1 pinned already (late-tenant)" in r.json()["error"]["message"]
    assert reg.desired_state().pins == {"late-tenant": "all"}
    r = httpx.post(
        f"{cluster.http}/v1/unpin_lora_adapter", json={"lora_name": "late-tenant"}, headers=admin
    )
    assert r.json()["was_pinned"] is True and reg.desired_state().pins == {}, r.text
    r = httpx.post(
        f"{cluster.http}/v1/unload_lora_adapter", json={"lora_name": "late-tenant"}, headers=admin
    )
    assert r.status_code == 200 and r.json()["state"] in ("draining", "removed")
    reg.close()
    with pytest.raises(openai.NotFoundError):  # draining or removed: the same 404
        complete(cluster, "late-tenant")
    # an adapter whose config names another base model: registered (shapes fit), with a warning
    other = Path(shutil.copytree(path, tmp_path / "other")) / "adapter_config.json"
    other.write_text(
        json.dumps({**json.loads(other.read_text()), "base_model_name_or_path": "o/m"})
    )
    body = {"lora_name": "other-base", "lora_path": str(other.parent)}
    r = httpx.post(f"{cluster.http}/v1/load_lora_adapter", json=body, headers=admin, timeout=30)
    assert r.json()["warning"].startswith(
        f"the adapter's config names base model 'o/m'; this cluster serves {cluster.base!r}"
    ), r.text


@pytest.mark.parametrize(
    "model, key, code",
    [
        ("no-such-adapter", "ops", grpc.StatusCode.NOT_FOUND),
        ("t1-private", "t2", grpc.StatusCode.NOT_FOUND),
        ("demo-poet", None, grpc.StatusCode.UNAUTHENTICATED),
        ("", "ops", grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_grpc_status_codes_mirror_rest(cluster, model, key, code):
    meta = cluster.grpc_auth(key) if key else ()
    req = pb.GenerateRequest(model=model, prompt=PROMPT, max_tokens=2)
    with pytest.raises(grpc.RpcError) as e:
        list(cluster.grpc_stub().Generate(req, metadata=meta))
    assert e.value.code() == code


def test_revoked_key_is_refused_on_rest_and_grpc(cluster):
    reg = cluster.registry()
    key = reg.issue_api_key("t1")
    body = {"model": "demo-poet", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}"}
    r = httpx.post(f"{cluster.http}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    reg.revoke_api_key("t1", key_id(hash_key(key)))
    reg.close()
    r = httpx.post(f"{cluster.http}/v1/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 401, r.text
    req = pb.GenerateRequest(model="demo-poet", prompt=PROMPT, max_tokens=2)
    with pytest.raises(grpc.RpcError) as e:
        list(cluster.grpc_stub().Generate(req, metadata=(("authorization", f"Bearer {key}"),)))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
