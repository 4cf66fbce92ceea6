import grpc
import pytest

from lora_core.errors import (
    AdapterDraining,
    AdapterIncompatible,
    AdapterLoadFailed,
    AdapterNotFound,
    AdapterVersionUnavailable,
    CapacityExceeded,
    InvalidRequest,
    LoraFleetError,
    NonFiniteLogits,
    RegistryUnavailable,
    ReplicaFailed,
    TenantRateLimited,
    Unauthorized,
)
from router.errors import openai_error_body, status_for, unwrap


@pytest.mark.parametrize(
    "exc, http, code, openai_type, retry",
    [
        (InvalidRequest("x"), 400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error", None),
        (Unauthorized("x"), 401, grpc.StatusCode.UNAUTHENTICATED, "authentication_error", None),
        (AdapterNotFound("a"), 404, grpc.StatusCode.NOT_FOUND, "invalid_request_error", None),
        (
            AdapterIncompatible("r", "p", "q"),
            400,
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid_request_error",
            None,
        ),
        (
            AdapterLoadFailed("x"),
            422,
            grpc.StatusCode.FAILED_PRECONDITION,
            "invalid_request_error",
            None,
        ),
        (AdapterDraining("a"), 503, grpc.StatusCode.UNAVAILABLE, "server_error", 1.0),
        (AdapterVersionUnavailable("x"), 503, grpc.StatusCode.UNAVAILABLE, "server_error", 1.0),
        (
            CapacityExceeded("full", retry_after_s=3.0),
            429,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "rate_limit_error",
            3.0,
        ),
        (
            TenantRateLimited("acme", 600, 17),
            429,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "rate_limit_error",
            17,
        ),
        (ReplicaFailed("x"), 503, grpc.StatusCode.UNAVAILABLE, "server_error", 1.0),
        (RegistryUnavailable("x"), 503, grpc.StatusCode.UNAVAILABLE, "server_error", 1.0),
        (NonFiniteLogits("r", 3), 500, grpc.StatusCode.INTERNAL, "server_error", None),
        (LoraFleetError("x"), 500, grpc.StatusCode.INTERNAL, "server_error", None),
        (KeyError("x"), 500, grpc.StatusCode.INTERNAL, "server_error", None),
    ],
)
def test_table(exc, http, code, openai_type, retry):
    s = status_for(exc)
    assert (s.http, s.grpc_code, s.openai_type, s.retry_after_s) == (http, code, openai_type, retry)


def test_a_tenant_over_its_limit_is_a_rate_limit_error_of_its_own_code():
    """Not capacity_exceeded: a client (or its operator) can tell its own limit from a full
    cluster."""
    assert openai_error_body(TenantRateLimited("acme", 600, 17)) == {
        "error": {
            "message": "tenant 'acme' sent requests faster than its limit of 600 per minute; "
            "allowed: a burst of up to 600 requests, then 600 per minute (retry after 17 s)",
            "type": "rate_limit_error",
            "param": None,
            "code": "tenant_rate_limited",
        }
    }


def test_openai_body_hides_internal_messages():
    assert openai_error_body(AdapterNotFound("t1")) == {
        "error": {
            "message": "adapter 't1' not found",
            "type": "invalid_request_error",
            "param": None,
            "code": "model_not_found",
        }
    }
    body = openai_error_body(RuntimeError("secret path /x"))
    assert body["error"]["message"] == "internal error (RuntimeError)"


class _Wrapper(Exception):
    def __init__(self, cause):
        super().__init__("wrapped")
        self.cause = cause


def test_unwrap_digs_out_the_lorafleet_error():
    inner = AdapterNotFound("t")
    assert unwrap(_Wrapper(_Wrapper(inner))) is inner
    plain = ValueError("v")
    assert unwrap(plain) is plain
    assert unwrap(_Wrapper(plain)) is plain


def test_unwrap_looks_inside_rays_error_that_poses_as_ours():
    """A replica's InvalidRequest reaches the ingress as "RayTaskError(InvalidRequest)":
    an InvalidRequest whose message is Ray's traceback and whose param is None."""
    from ray.exceptions import RayTaskError

    inner = InvalidRequest("logit_bias: token id 999 out of range", "logit_bias")
    wrapped = RayTaskError("generate", "Traceback (most recent call last): ...", inner)
    dual = wrapped.as_instanceof_cause()
    assert isinstance(dual, InvalidRequest) and dual.param is None
    assert unwrap(dual) is inner
    assert openai_error_body(unwrap(dual))["error"]["param"] == "logit_bias"


def test_a_short_message_is_shown_verbatim():
    from router.errors import public_message

    message = "max_tokens=0; allowed: an integer >= 1"
    assert public_message(InvalidRequest(message)) == message


def test_a_long_message_is_cut_in_its_middle_keeping_what_is_allowed():
    # a seed of 4000 digits (under Python's 4300-digit limit) was echoed in full
    from router.body_parse import parse_body
    from router.errors import MAX_MESSAGE_CHARS, public_message
    from router.openai_protocol import CompletionRequest

    digits = "9" * 4000
    with pytest.raises(InvalidRequest) as e:
        body = f'{{"model": "m", "prompt": "x", "seed": {digits}}}'
        parse_body(CompletionRequest, body).to_sampling_params()
    full = str(e.value)
    shown = public_message(e.value)
    assert len(full) > 4000 and len(shown) <= MAX_MESSAGE_CHARS + 60
    assert shown.startswith(full[:700]) and shown.endswith(full[-200:])
    assert f"({len(full) - 900} characters left out)" in shown
    assert openai_error_body(e.value)["error"]["message"] == shown
