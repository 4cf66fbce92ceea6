"""Client errors out of Ray Serve's error log.

A gRPC refusal (an unknown adapter, a bad key, a full queue) sets its status on Serve's
gRPC context and raises (`router.grpc_service`: returning would lose the code of a
stream), and Serve (2.60) logs every raised error as ERROR with its traceback: the
replica's "Request failed." and the proxy's "Request failed with user-set gRPC status
code ...". REST answers the same errors with a response, which Serve logs only as an
access-log line. `ClientErrorFilter`, on Serve's logger in the ingress, the proxy and the
replicas (a client's error found only in a replica: a request too big for its KV cache),
turns such a record into one INFO line naming the status and message, without the
traceback, so both APIs log a client's error alike and an operator's ERROR lines stay
for server errors (5xx: internal, registry down, replica failed), tracebacks included.
"""

from __future__ import annotations

import logging

from ray.serve.exceptions import gRPCStatusError

from lora_core.errors import LoraFleetError
from lora_core.serve_logging import install_log_filters
from router.errors import public_message, status_for, unwrap


def client_error(exc: BaseException | None) -> LoraFleetError | None:
    """The lorafleet error inside exc when a client caused it (a 4xx in the error table),
    else None. exc as Serve logs it: a gRPCStatusError around the ingress's error, itself
    inside Ray's RayTaskError in the proxy."""
    for _ in range(4):
        if exc is None:
            return None
        exc = unwrap(exc)
        if not isinstance(exc, gRPCStatusError):
            break
        exc = exc.original_exception
    if isinstance(exc, LoraFleetError) and status_for(exc).http < 500:
        return exc
    return None


class ClientErrorFilter(logging.Filter):
    """Rewrites an ERROR record whose exception is a client's error (`client_error`) into
    one INFO line without traceback; passes every record on."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not record.exc_info:
            return True
        err = client_error(record.exc_info[1])
        if err is None:
            return True
        status = status_for(err)
        record.msg = "Request refused (%s, HTTP %d, %s): %s"
        record.args = (status.grpc_code.name, status.http, type(err).__name__,
                       public_message(err))  # fmt: skip
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.exc_info, record.exc_text = None, None
        return True


def install_client_error_filter() -> None:
    """Adds `ClientErrorFilter` to Serve's logger of this process, once (replicas get it
    through `ReplicaSettings.log_filters`)."""
    install_log_filters((ClientErrorFilter(),))
