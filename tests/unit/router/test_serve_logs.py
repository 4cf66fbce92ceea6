"""Serve's error records of client errors become one INFO line without traceback; server
errors keep their ERROR and traceback (records made as Serve makes them: the replica's
`logger.exception("Request failed.")` on a gRPCStatusError, the proxy's on Ray's
RayTaskError around it). tests/integration/serve/test_grpc_logs.py reads a live
cluster's log files."""

import io
import logging

import pytest
from ray.exceptions import RayTaskError
from ray.serve.exceptions import gRPCStatusError

from lora_core.errors import (
    AdapterNotFound,
    CapacityExceeded,
    InvalidRequest,
    NonFiniteLogits,
    RegistryUnavailable,
    Unauthorized,
)
from lora_core.serve_logging import SERVE_LOGGER
from router.errors import status_for
from router.serve_logs import ClientErrorFilter, install_client_error_filter


def as_serve_raises(err: Exception) -> gRPCStatusError:
    """err raised by the ingress after setting its status: Serve's wrapper, chained."""
    try:
        try:
            raise err
        except Exception as e:
            status = status_for(e)
            raise gRPCStatusError(e, status.grpc_code, str(e)) from e
    except gRPCStatusError as wrapped:
        return wrapped


def as_proxy_sees(wrapped: gRPCStatusError) -> Exception:
    """What the proxy gets from the replica: Ray's dual RayTaskError(gRPCStatusError)."""
    return RayTaskError(
        "Generate", "Traceback (most recent call last): ...", wrapped
    ).as_instanceof_cause()


def logged(exc: Exception, message: str = "Request failed.") -> tuple[str, str]:
    """(level name, formatted text) of `logger.exception(message)` while exc is handled."""
    logger = logging.getLogger(f"{SERVE_LOGGER}.test-{id(exc)}")
    logger.propagate = False
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.addFilter(ClientErrorFilter())
    levels = []
    logger.addFilter(lambda record: levels.append(record.levelname) or True)
    try:
        raise exc
    except Exception:
        logger.exception(message)
    return levels[0], out.getvalue()


CLIENT = [
    (AdapterNotFound("ghost"), "NOT_FOUND, HTTP 404, AdapterNotFound): adapter 'ghost' not found"),
    (InvalidRequest("prompt: empty", "prompt"), "INVALID_ARGUMENT, HTTP 400, InvalidRequest"),
    (Unauthorized("invalid API key"), "UNAUTHENTICATED, HTTP 401, Unauthorized"),
    (CapacityExceeded("all replicas are at their queue limit"), "RESOURCE_EXHAUSTED, HTTP 429"),
]
SERVER = [
    NonFiniteLogits("req-1", 0),
    RegistryUnavailable("redis://127.0.0.1:1 cannot be reached"),
    RuntimeError("a bug"),
]


@pytest.mark.parametrize("err, line", CLIENT)
@pytest.mark.parametrize("where", ["replica", "proxy"])
def test_a_client_error_is_one_info_line_without_traceback(err, line, where):
    exc = as_serve_raises(err)
    exc = as_proxy_sees(exc) if where == "proxy" else exc
    level, text = logged(exc)
    assert level == "INFO"
    assert text.startswith(f"INFO Request refused ({line}") and text.count("\n") == 1, text
    assert "Traceback" not in text


@pytest.mark.parametrize("err", SERVER)
@pytest.mark.parametrize("where", ["replica", "proxy", "unwrapped"])
def test_a_server_error_keeps_its_error_and_traceback(err, where):
    exc = err if where == "unwrapped" else as_serve_raises(err)
    exc = as_proxy_sees(exc) if where == "proxy" else exc
    level, text = logged(exc)
    assert level == "ERROR" and text.startswith("ERROR Request failed.\nTraceback"), text


def test_records_without_an_exception_pass_unchanged():
    logger = logging.getLogger(SERVE_LOGGER + ".plain")
    record = logger.makeRecord(logger.name, logging.ERROR, "f", 1, "boom", None, None)
    assert ClientErrorFilter().filter(record) and record.levelname == "ERROR"


def test_install_adds_the_filter_once():
    logger = logging.getLogger(SERVE_LOGGER)
    before = list(logger.filters)
    # Another test of this process may have installed it already (the ingress does).
    logger.filters[:] = [f for f in before if not isinstance(f, ClientErrorFilter)]
    try:
        install_client_error_filter()
        install_client_error_filter()
        added = [f for f in logger.filters if isinstance(f, ClientErrorFilter)]
        assert len(added) == 1
    finally:
        logger.filters[:] = before
