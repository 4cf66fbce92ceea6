"""The ingress reads at most max_request_bytes (32 MiB by default) of a request body: a
larger one is a 413 in the OpenAI error shape, refused by its Content-Length before it is
read, or as soon as a body streamed without one (chunked) passes the limit; on every
route that reads a body. A body under the limit is served as before."""

from __future__ import annotations

import httpx
import pytest

from router.ingress import MAX_REQUEST_BYTES
from tests.integration.serve.cluster_fixture import ADMIN_KEY
from tests.integration.serve.sampling.test_sampling_api import PROMPT

pytestmark = pytest.mark.integration
ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/load_lora_adapter"]


def _post(cluster, path: str, content) -> httpx.Response:
    key = ADMIN_KEY if path.startswith("/v1/load_lora") else cluster.keys["ops"]
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return httpx.post(f"{cluster.http}{path}", content=content, headers=headers, timeout=60)


def _big() -> bytes:
    """A JSON body one byte over the limit (a prompt of spaces)."""
    head, tail = b'{"model": "demo-poet", "prompt": "', b'"}'
    return head + b" " * (MAX_REQUEST_BYTES + 1 - len(head) - len(tail)) + tail


@pytest.mark.parametrize("path", ROUTES)
def test_a_body_over_the_limit_is_413(cluster, path):
    body = _big()
    r = _post(cluster, path, body)
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"], err["type"]) == (
        "request_too_large",
        "body",
        "invalid_request_error",
    )
    assert err["message"] == (
        f"body: {len(body)} bytes; allowed: at most {MAX_REQUEST_BYTES} bytes (max_request_bytes)"
    )


def test_a_chunked_body_is_cut_off_at_the_limit(cluster):
    body = _big()

    def chunks():
        for i in range(0, len(body), 1 << 20):
            yield body[i : i + (1 << 20)]

    r = _post(cluster, "/v1/completions", chunks())
    assert r.status_code == 413, r.text
    assert r.json()["error"]["message"].startswith("body: at least ")


def test_a_body_under_the_limit_is_served(cluster):
    body = b'{"model": "demo-poet", "prompt": "%s", "max_tokens": 2}' % PROMPT.encode()
    assert _post(cluster, "/v1/completions", body).status_code == 200
