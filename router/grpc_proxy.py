"""The proxy's side of the gRPC API: the `grpc_servicer_functions` entry of Serve's gRPC
options (`deploy/cluster.yaml`), run in Serve's proxy actor.

Serve's gRPC proxy (Ray 2.60) copies a deployment's trailing metadata to the client only
along with a response message: a call that ends in an error arrives with the code and
details the ingress set and no trailers at all (the ingress's own `set_trailing_metadata`
was lost that way). So a retryable refusal carries its hint at the end of its details
("... (retry after 1 s)", `router.grpc_service`), and the handlers registered here copy
it into a `retry-after` trailer once Serve's handler has set the final status: a client
reads it as a REST client reads the Retry-After header.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Callable

import grpc

from router.proto import lorafleet_pb2_grpc as pb_grpc
from router.serve_logs import install_client_error_filter

log = logging.getLogger("lorafleet.router")
RETRY_HINT = re.compile(r" \(retry after ([0-9]+) s\)$")


def retry_hint(details: str | None) -> str | None:
    """The seconds of the retry hint ending a status's details, else None.
    Example: "all replicas are at their queue limit (...) (retry after 2 s)" -> "2"."""
    found = RETRY_HINT.search(details or "")
    return found.group(1) if found else None


def add_retry_trailer(context: grpc.aio.ServicerContext) -> None:
    """Adds `retry-after` to the call's trailers when its details end in a retry hint."""
    seconds = retry_hint(context.details())
    if seconds is not None:
        trailers = tuple(context.trailing_metadata() or ())
        context.set_trailing_metadata((*trailers, ("retry-after", seconds)))


def with_retry_trailer(handler: Callable) -> Callable:
    """A method handler (request, context), unary or streaming, that adds the trailer
    after `handler` has answered."""
    if inspect.isasyncgenfunction(handler):

        async def streaming(request, context):
            async for message in handler(request, context):
                yield message
            add_retry_trailer(context)

        return streaming

    async def unary(request, context):
        response = await handler(request, context)
        add_retry_trailer(context)
        return response

    return unary


def add_inference_servicer(servicer: object, server: grpc.aio.Server) -> None:
    """Registers `lorafleet.v1.Inference` as `add_InferenceServicer_to_server` does, each
    method's handler adding the retry-after trailer. Serve's server builds the handlers
    with its `service_handler_factory` while they are registered; a server without one
    (another Serve release) gets Serve's own handlers, the hint then in the details only.
    Runs in the proxy actor, so it also keeps client errors out of the proxy's error log
    (`router.serve_logs`)."""
    install_client_error_filter()
    factory = getattr(server, "service_handler_factory", None)
    if factory is None:
        log.warning("the gRPC server has no service_handler_factory: no retry-after trailers")
        pb_grpc.add_InferenceServicer_to_server(servicer, server)
        return

    def wrapped_factory(service_method: str, streaming_type) -> Callable:
        return with_retry_trailer(
            factory(service_method=service_method, streaming_type=streaming_type)
        )

    server.service_handler_factory = wrapped_factory
    try:
        pb_grpc.add_InferenceServicer_to_server(servicer, server)
    finally:
        server.service_handler_factory = factory
