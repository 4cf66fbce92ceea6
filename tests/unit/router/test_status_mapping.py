"""REST responses and gRPC status for errors (pure: no Ray cluster, no sockets)."""

import json

import grpc
import pytest

from lora_core.errors import (
    AdapterNotFound,
    CapacityExceeded,
    InvalidRequest,
    RegistryUnavailable,
    TenantRateLimited,
)
from replica.sampling_params import SamplingParams
from router.body_parse import parse_body
from router.grpc_proxy import retry_hint
from router.grpc_service import _fail, grpc_api_key, sampling_of
from router.openai_protocol import CompletionRequest
from router.proto import lorafleet_pb2 as pb
from router.rest import error_response


class FakeContext:
    def __init__(self, metadata=()):
        self.metadata = list(metadata)
        self.code = self.details = None

    def invocation_metadata(self):
        return self.metadata

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


@pytest.mark.parametrize(
    "exc, status, retry_after",
    [
        (InvalidRequest("bad"), 400, None),
        (AdapterNotFound("x"), 404, None),
        (CapacityExceeded("full", retry_after_s=2.6), 429, "3"),
        (TenantRateLimited("acme", 600, 17), 429, "17"),
        (RegistryUnavailable("down"), 503, "1"),
    ],
)
def test_rest_error_response(exc, status, retry_after):
    r = error_response(exc)
    assert r.status_code == status
    assert r.headers.get("retry-after") == retry_after
    assert json.loads(r.body)["error"]["message"] == str(exc)


@pytest.mark.parametrize(
    "exc, code, details, hint",
    [
        (AdapterNotFound("x"), grpc.StatusCode.NOT_FOUND, "adapter 'x' not found", None),
        (
            CapacityExceeded("full", retry_after_s=2.6),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "full (retry after 3 s)",
            "3",
        ),
        (
            TenantRateLimited("acme", 60, 17),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            # its message ends in the hint already: the time is named once
            "tenant 'acme' sent requests faster than its limit of 60 per minute; allowed: a "
            "burst of up to 60 requests, then 60 per minute (retry after 17 s)",
            "17",
        ),
        (RegistryUnavailable("down"), grpc.StatusCode.UNAVAILABLE, "down (retry after 1 s)", "1"),
        (ValueError("secret"), grpc.StatusCode.INTERNAL, "internal error (ValueError)", None),
    ],
)
def test_grpc_status(exc, code, details, hint):
    """A retry time ends the details, once (Serve's proxy drops a failed call's trailers;
    its handlers turn the hint into the retry-after trailer: test_grpc_proxy.py)."""
    ctx = FakeContext()
    assert _fail(ctx, exc) is exc
    assert (ctx.code, ctx.details) == (code, details)
    assert retry_hint(ctx.details) == hint  # the proxy's retry-after trailer


def test_grpc_metadata_key_and_sampling_defaults():
    assert grpc_api_key(FakeContext([("authorization", "Bearer k1")])) == "k1"
    assert grpc_api_key(FakeContext([("application", "x")])) is None
    assert sampling_of(pb.GenerateRequest(model="m")) == SamplingParams(
        max_tokens=16, temperature=0.0
    )
    req = pb.GenerateRequest(
        model="m", max_tokens=3, temperature=0.5, top_p=0.5, seed=0, stop=["x"]
    )
    assert sampling_of(req) == SamplingParams(
        max_tokens=3, temperature=0.5, top_p=0.5, seed=0, stop=("x",)
    )


def _refusal(build) -> str:
    with pytest.raises(InvalidRequest) as e:
        build()
    return str(e.value)


@pytest.mark.parametrize(
    "field, value",
    [("temperature", 5.0), ("temperature", -0.5), ("top_p", 1.5), ("top_p", -0.25)],
)
def test_rest_and_grpc_share_one_sampling_rule_set(field, value):
    rest_body = {"model": "m", "prompt": "x", field: value}
    rest = _refusal(lambda: parse_body(CompletionRequest, rest_body).to_sampling_params())
    grpc_ = _refusal(lambda: sampling_of(pb.GenerateRequest(model="m", **{field: value})))
    assert (
        rest
        == grpc_
        == f"{field}={value!r}; allowed: "
        + {
            "temperature": "0 <= temperature <= 2",
            "top_p": "0 < top_p <= 1",
        }[field]
    )


@pytest.mark.parametrize("seed", [-(2**63), 2**63 - 1])
def test_rest_and_grpc_accept_the_same_seed_range(seed):
    rest_body = {"model": "m", "prompt": "x", "seed": seed}
    assert parse_body(CompletionRequest, rest_body).to_sampling_params().seed == seed
    assert sampling_of(pb.GenerateRequest(model="m", seed=seed)).seed == seed
    with pytest.raises(ValueError):  # an int64 field: the client library refuses the rest
        pb.GenerateRequest(model="m", seed=seed + (1 if seed > 0 else -1))
