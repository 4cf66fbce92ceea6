"""Backpressure end to end: a replica at its ongoing + queued limit answers 429/503 with
Retry-After and the OpenAI error JSON (REST) or RESOURCE_EXHAUSTED / UNAVAILABLE with a
retry hint in the details and the retry-after trailer (gRPC); the requests that fit are
served; nothing is a 500."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from router.proto import lorafleet_pb2 as pb
from router.proto import lorafleet_pb2_grpc as pb_grpc
from tests.integration.serve.cluster_fixture import start_cluster, stop_cluster

pytestmark = pytest.mark.integration

LONG = {
    "model": "demo-poet",
    "prompt": "hello world",
    "max_tokens": 48,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def tight(tmp_path_factory):
    cluster = start_cluster(
        tmp_path_factory.mktemp("tight"),
        auth=False,
        num_replicas=1,
        max_ongoing_requests=1,
        max_queued_requests=1,
    )
    yield cluster
    stop_cluster(cluster)


def test_rest_over_capacity_is_429_or_503_with_retry_after(tight):
    async def go():
        async with httpx.AsyncClient(base_url=tight.http, timeout=120) as client:
            return await asyncio.gather(
                *[client.post("/v1/completions", json=LONG) for _ in range(8)]
            )

    responses = asyncio.run(go())
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and set(codes) <= {200, 429, 503} and len(set(codes)) > 1, codes
    for r in responses:
        if r.status_code != 200:
            assert int(r.headers["Retry-After"]) >= 1
            err = r.json()["error"]
            assert err["type"] and err["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] == LONG["max_tokens"]


def test_grpc_over_capacity_is_unavailable_or_exhausted(tight):
    async def one(stub):
        try:
            chunks = [
                c
                async for c in stub.Generate(
                    pb.GenerateRequest(model="demo-poet", prompt="hello", max_tokens=48)
                )
            ]
            return "ok", chunks[-1].finish_reason
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details(), e.trailing_metadata()

    async def go():
        async with grpc.aio.insecure_channel(tight.grpc) as channel:
            stub = pb_grpc.InferenceStub(channel)
            return await asyncio.gather(*[one(stub) for _ in range(8)])

    results = asyncio.run(go())
    kinds = {r[0] for r in results}
    assert "ok" in kinds, results
    refused = [r for r in results if r[0] != "ok"]
    assert refused, results
    for code, details, trailers in refused:
        assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED), code
        assert "queue limit" in details and details.endswith(" (retry after 1 s)"), details
        # the client reads the retry time from the trailers too, as REST's Retry-After
        assert ("retry-after", "1") in tuple(trailers), trailers


def test_n_choices_count_as_n_requests_against_the_limits(tight):
    """Each choice is one engine request: three choices never fit a replica taking 1
    running + 1 queued (n = 1 does): 429/503 with Retry-After, and the next request is
    served."""
    full = httpx.post(f"{tight.http}/v1/completions", json={**LONG, "n": 3}, timeout=120)
    assert full.status_code in (429, 503), full.text
    assert int(full.headers["Retry-After"]) >= 1
    assert "queue limit" in full.json()["error"]["message"]
    one = httpx.post(f"{tight.http}/v1/completions", json=LONG, timeout=120)
    assert one.status_code == 200, one.text
    assert one.json()["usage"]["completion_tokens"] == LONG["max_tokens"]
