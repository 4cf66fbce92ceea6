"""The proxy's retry-after trailer (router.grpc_proxy), on Serve's own gRPC server class
with a stand-in for its handler factory (no Ray, no sockets; the live test is
tests/integration/serve/test_backpressure.py)."""

import asyncio
from unittest.mock import Mock

import grpc
import pytest
from ray.serve._private.grpc_util import gRPCGenericServer

from router.grpc_proxy import add_inference_servicer, add_retry_trailer, retry_hint

GENERATE, LIST_MODELS = "/lorafleet.v1.Inference/Generate", "/lorafleet.v1.Inference/ListModels"


class AioContext:
    """The part of grpc.aio.ServicerContext the handlers use."""

    def __init__(self, details: str | None = None, trailers=()):
        self._code, self._details, self._trailers = None, details, tuple(trailers)

    def set_code(self, code):
        self._code = code

    def set_details(self, details):
        self._details = details

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailers

    def set_trailing_metadata(self, trailers):
        self._trailers = tuple(trailers)


@pytest.mark.parametrize(
    "details, hint",
    [
        ("all replicas are at their queue limit (x) (retry after 1 s)", "1"),
        ("registry down (retry after 12 s)", "12"),
        ("adapter 'x' not found", None),
        ("a prompt saying (retry after 1 s) in the middle", None),
        ("(retry after 1.5 s)", None),
        ("", None),
        (None, None),
    ],
)
def test_retry_hint_is_read_from_the_end_of_the_details(details, hint):
    assert retry_hint(details) == hint


def test_the_trailer_is_added_to_the_trailers_already_set():
    ctx = AioContext("full (retry after 3 s)", [("request_id", "r1")])
    add_retry_trailer(ctx)
    assert ctx.trailing_metadata() == (("request_id", "r1"), ("retry-after", "3"))
    ctx = AioContext("adapter 'x' not found")
    add_retry_trailer(ctx)
    assert ctx.trailing_metadata() == ()


def serve_like_factory(details: str):
    """Serve's handlers end a refused call by setting its status on the context."""

    def factory(service_method: str, streaming_type):
        async def unary(request, context):
            context.set_code(grpc.StatusCode.UNAVAILABLE)
            context.set_details(f"{service_method}: {details}")
            return b""

        async def streaming(request, context):
            yield b"chunk"
            context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
            context.set_details(f"{service_method}: {details}")

        return streaming if streaming_type.value.endswith("stream") else unary

    return factory


def registered(server: gRPCGenericServer) -> dict:
    (handlers,) = server.generic_rpc_handlers
    return handlers[0]._method_handlers


@pytest.mark.parametrize(
    "details, trailers", [("full (retry after 2 s)", (("retry-after", "2"),)), ("not found", ())]
)
def test_the_registered_handlers_add_the_trailer_after_serves_handler(details, trailers):
    async def go():
        factory = serve_like_factory(details)
        server = gRPCGenericServer(factory)
        add_inference_servicer(Mock(), server)
        assert server.service_handler_factory is factory
        methods = registered(server)
        generate, list_models = AioContext(), AioContext()
        got = [m async for m in methods[GENERATE].unary_stream(b"req", generate)]
        reply = await methods[LIST_MODELS].unary_unary(b"req", list_models)
        return got, reply, generate, list_models

    got, reply, generate, list_models = asyncio.run(go())
    assert (got, reply) == ([b"chunk"], b"")
    assert generate.details() == f"{GENERATE}: {details}"
    assert generate.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert generate.trailing_metadata() == trailers
    assert list_models.trailing_metadata() == trailers


def test_a_server_without_a_handler_factory_gets_the_plain_handlers():
    server = Mock(spec=["add_generic_rpc_handlers", "add_registered_method_handlers"])
    add_inference_servicer(Mock(), server)
    server.add_generic_rpc_handlers.assert_called_once()
