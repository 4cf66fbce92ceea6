"""The one table mapping lorafleet errors to HTTP status, gRPC code and OpenAI error type.

REST and gRPC both answer through `status_for`; nothing else decides a status code.
Ray wraps exceptions raised inside a replica (`RayTaskError`); `unwrap` digs the
original lorafleet error back out so the table sees the real type.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from lora_core.errors import (
    AdapterAlreadyExists,
    AdapterDraining,
    AdapterIncompatible,
    AdapterLoadFailed,
    AdapterNotFound,
    AdapterVersionUnavailable,
    CapacityExceeded,
    InvalidRequest,
    LoraFleetError,
    ModelLoadFailed,
    NonFiniteLogits,
    PinRefused,
    RegistryUnavailable,
    ReplicaFailed,
    RequestTooLarge,
    StaleEpoch,
    TenantRateLimited,
    Unauthorized,
)


@dataclass(frozen=True)
class ErrorStatus:
    """How one error type is answered.

    http: HTTP status code.
    grpc_code: gRPC status code.
    openai_type: the `error.type` of the OpenAI error JSON.
    code: the `error.code` of the OpenAI error JSON (a stable machine-readable name).
    retry_after_s: seconds for the Retry-After header / trailer (None: not retryable).
    """

    http: int
    grpc_code: grpc.StatusCode
    openai_type: str
    code: str
    retry_after_s: float | None = None


_S = grpc.StatusCode
# Most specific first: `status_for` takes the first entry the error is an instance of.
ERROR_TABLE: tuple[tuple[type[BaseException], ErrorStatus], ...] = (
    (
        RequestTooLarge,
        ErrorStatus(413, _S.RESOURCE_EXHAUSTED, "invalid_request_error", "request_too_large"),
    ),
    (
        InvalidRequest,
        ErrorStatus(400, _S.INVALID_ARGUMENT, "invalid_request_error", "invalid_request"),
    ),
    (Unauthorized, ErrorStatus(401, _S.UNAUTHENTICATED, "authentication_error", "invalid_api_key")),
    (AdapterNotFound, ErrorStatus(404, _S.NOT_FOUND, "invalid_request_error", "model_not_found")),
    (
        AdapterIncompatible,
        ErrorStatus(400, _S.INVALID_ARGUMENT, "invalid_request_error", "adapter_incompatible"),
    ),
    (
        AdapterLoadFailed,
        ErrorStatus(422, _S.FAILED_PRECONDITION, "invalid_request_error", "adapter_load_failed"),
    ),
    (
        AdapterAlreadyExists,
        ErrorStatus(409, _S.ALREADY_EXISTS, "invalid_request_error", "adapter_exists"),
    ),
    (PinRefused, ErrorStatus(409, _S.FAILED_PRECONDITION, "invalid_request_error", "pin_refused")),
    (AdapterDraining, ErrorStatus(503, _S.UNAVAILABLE, "server_error", "adapter_draining", 1.0)),
    (
        AdapterVersionUnavailable,
        ErrorStatus(503, _S.UNAVAILABLE, "server_error", "adapter_version_unavailable", 1.0),
    ),
    (
        CapacityExceeded,
        ErrorStatus(429, _S.RESOURCE_EXHAUSTED, "rate_limit_error", "capacity_exceeded", 1.0),
    ),
    (
        TenantRateLimited,
        ErrorStatus(429, _S.RESOURCE_EXHAUSTED, "rate_limit_error", "tenant_rate_limited", 1.0),
    ),
    (
        RegistryUnavailable,
        ErrorStatus(503, _S.UNAVAILABLE, "server_error", "registry_unavailable", 1.0),
    ),
    (ReplicaFailed, ErrorStatus(503, _S.UNAVAILABLE, "server_error", "replica_failed", 1.0)),
    (ModelLoadFailed, ErrorStatus(500, _S.INTERNAL, "server_error", "model_load_failed")),
    (StaleEpoch, ErrorStatus(500, _S.INTERNAL, "server_error", "stale_epoch")),
    (NonFiniteLogits, ErrorStatus(500, _S.INTERNAL, "server_error", "non_finite_logits")),
    (LoraFleetError, ErrorStatus(500, _S.INTERNAL, "server_error", "internal_error")),
)
INTERNAL = ErrorStatus(500, _S.INTERNAL, "server_error", "internal_error")


def status_for(exc: BaseException) -> ErrorStatus:
    """The answer for `exc` (after `unwrap`); anything unknown is an internal error."""
    for cls, status in ERROR_TABLE:
        if isinstance(exc, cls):
            if isinstance(exc, (CapacityExceeded, TenantRateLimited)):
                return _with_retry(status, exc.retry_after_s)
            return status
    return INTERNAL


def _with_retry(status: ErrorStatus, retry_after_s: float) -> ErrorStatus:
    return ErrorStatus(
        status.http, status.grpc_code, status.openai_type, status.code, retry_after_s
    )


def unwrap(exc: BaseException) -> BaseException:
    """The original error inside Ray's wrappers (RayTaskError chains), else `exc` itself.

    Ray raises a replica's error as a class deriving from both RayTaskError and the
    error's own type ("RayTaskError(InvalidRequest)"): it passes isinstance checks, but
    its message is Ray's traceback and its param is lost, so the chain is followed to
    its end even through wrappers that already look like lorafleet errors."""
    for _ in range(8):
        cause = getattr(exc, "cause", None)
        if not isinstance(cause, BaseException) or cause is exc:
            break
        exc = cause
    return exc


MAX_MESSAGE_CHARS = 1000
"""A longer message is cut in its middle: a message quotes what came (a number of 4300
digits, a long stop string), and the client already has it; the end says what is
allowed."""


def public_message(exc: BaseException) -> str:
    """The message shown to clients: ours (cut to MAX_MESSAGE_CHARS), internals reduced
    to their type name.

    Example: a message of 5000 characters -> its first 700, "... (4000 characters left
    out) ...", its last 200.
    """
    if not isinstance(exc, LoraFleetError):
        return f"internal error ({type(exc).__name__})"
    message = str(exc)
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    head, tail = 700, 200
    cut = len(message) - head - tail
    return f"{message[:head]} ... ({cut} characters left out) ... {message[-tail:]}"


def openai_error_body(exc: BaseException) -> dict[str, dict[str, str | None]]:
    """The OpenAI error JSON for `exc`: {"error": {"message", "type", "param", "code"}}."""
    status = status_for(exc)
    param = exc.param if isinstance(exc, LoraFleetError) else None
    return error_json(public_message(exc), status.openai_type, status.code, param)


def error_json(
    message: str, openai_type: str, code: str, param: str | None = None
) -> dict[str, dict[str, str | None]]:
    """The OpenAI error JSON: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": openai_type, "param": param, "code": code}}
