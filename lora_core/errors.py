"""One error hierarchy for all of lorafleet (torch-free, so `cluster` can import it).

Every error a user can cause is one of these types. `router/errors.py` maps each
type to an HTTP status and a gRPC status code in one table; nothing else decides
status codes. Messages say what was wrong and what is allowed.
"""

from __future__ import annotations


class LoraFleetError(Exception):
    """Base of every lorafleet error. `retryable` tells clients whether to retry.

    param: the request field at fault (dotted path, e.g. "messages.0.content") when
    known; it becomes the OpenAI error JSON's `param`. `InvalidRequest` takes it as an
    argument; an endpoint sets it on an error raised by code that knows no request
    bodies (the registry refusing a registration's lora_path, say).

    Errors cross process boundaries (a replica's error reaches the ingress through Ray's
    pickling): they pickle as (class, message, attributes) and unpickle without calling
    the subclass's __init__, whose arguments differ from the message in `args`.
    """

    retryable: bool = False
    param: str | None = None

    def __reduce__(self):
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type[LoraFleetError], args: tuple, state: dict) -> LoraFleetError:
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class InvalidRequest(LoraFleetError):
    """The request itself is malformed (bad field, value out of range); `param` names
    the offending field when known."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class RequestTooLarge(InvalidRequest):
    """A request body over the ingress's byte limit (413: refused before it is read whole)."""


class AdapterError(LoraFleetError):
    """Base of adapter errors."""


class AdapterNotFound(AdapterError):
    """Unknown adapter, or one the caller may not use (the same answer: existence must not leak)."""

    def __init__(self, name: str):
        super().__init__(f"adapter {name!r} not found")
        self.name = name


class AdapterIncompatible(AdapterError):
    """The adapter's config or tensors do not fit this base model or engine.

    `field` names the offending config field (or tensor), `allowed` what would be accepted.
    """

    def __init__(self, field: str, problem: str, allowed: str):
        super().__init__(f"{field}: {problem}; allowed: {allowed}")
        self.field = field
        self.problem = problem
        self.allowed = allowed


class AdapterLoadFailed(AdapterError):
    """The adapter's files are missing, unreadable, corrupt or in a refused format (pickle)."""


class AdapterDraining(AdapterError):
    """The adapter is being unloaded/unregistered: new requests for it are refused."""

    def __init__(self, name: str):
        super().__init__(f"adapter {name!r} is being unloaded; new requests are refused")
        self.name = name


class AdapterVersionUnavailable(AdapterError):
    """This replica does not hold the requested adapter version (yet); retry elsewhere."""

    retryable = True


class AdapterAlreadyExists(AdapterError):
    """Registering a name that exists without asking to replace it."""


class PinRefused(AdapterError):
    """Pinning would leave no evictable slot (or the adapter is not loaded)."""


class Unauthorized(LoraFleetError):
    """Missing or bad API key."""


class CapacityExceeded(LoraFleetError):
    """Backpressure: queue full or no slot can be made free now. Retry later."""

    retryable = True

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TenantRateLimited(LoraFleetError):
    """A tenant sent requests faster than its limit allows (its own, set by `lorafleet
    tenants limit`, else the cluster's tenant_requests_per_minute: a burst of up to that
    many, then that many per minute; `router.rate_limit`). Retry after retry_after_s: the
    whole seconds until its next request would be admitted. The message ends in the retry
    hint gRPC's details carry ("(retry after N s)", `router.grpc_proxy`), so gRPC sends it
    as it is, naming the time once."""

    retryable = True

    def __init__(self, tenant: str, limit: int, retry_after_s: int):
        super().__init__(
            f"tenant {tenant!r} sent requests faster than its limit of {limit} per minute; "
            f"allowed: a burst of up to {limit} requests, then {limit} per minute "
            f"(retry after {retry_after_s} s)"
        )
        self.tenant = tenant
        self.limit = limit
        self.retry_after_s = retry_after_s


class ReplicaFailed(LoraFleetError):
    """The replica running a request stopped (crashed, killed) after it began answering.
    Sending the request again is safe: another replica takes it."""

    retryable = True


class ModelLoadFailed(LoraFleetError):
    """The base model directory or hub id cannot be read or is unsupported."""


class NonFiniteLogits(LoraFleetError):
    """The model's logits for a request were NaN or infinite (bad weights, an overflowing
    dtype): the request stops with an error instead of emitting an arbitrary token."""

    def __init__(self, request_id: str, position: int):
        super().__init__(
            f"request {request_id}: the model's logits at output token {position} are not "
            "finite (NaN or inf); generation stopped. The base model or adapter weights, "
            "or the dtype, overflow"
        )
        self.request_id = request_id
        self.position = position


class RegistryUnavailable(LoraFleetError):
    """Redis cannot be reached (the message names the URL tried)."""

    retryable = True


class StaleEpoch(LoraFleetError):
    """A replica wrote with an epoch older than its current registration (fenced off)."""
