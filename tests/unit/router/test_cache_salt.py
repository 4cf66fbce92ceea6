"""Prefix-cache salts: the ingress salts each request with its tenant (scope "tenant",
the default) and the request's own cache_salt (REST and gRPC), so tenants never share KV
blocks unless the operator chose "shared"; bad salts are refused naming the field."""

import pytest

from lora_core.errors import InvalidRequest
from replica.sampling_params import SamplingParams
from router.auth import AdapterResolver
from router.body_parse import parse_body
from router.frontend import Frontend
from router.grpc_service import cache_salt_of_request
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from router.prepared import cache_salt_of
from router.proto import lorafleet_pb2 as pb
from tests.unit.router.test_frontend_auth import (
    BASE,
    Dispatcher,
    FakeRegistry,
    prepare,
    tokenizer,
)

__all__ = ["tokenizer"]  # the module fixture, shared


@pytest.mark.parametrize(
    "tenant, salt, scope, want",
    [
        ("t1", None, "tenant", "t1\x00"),
        ("t1", "u7", "tenant", "t1\x00u7"),
        ("t1", None, "shared", ""),
        ("t1", "u7", "shared", "\x00u7"),
        (None, None, "tenant", ""),  # auth off: no tenant, blocks shared
        (None, "u7", "tenant", "\x00u7"),
    ],
)
def test_cache_salt_of(tenant, salt, scope, want):
    assert cache_salt_of(tenant, salt, scope) == want


def test_an_unknown_scope_is_refused():
    with pytest.raises(ValueError, match="prefix_cache_scope='users'; allowed"):
        cache_salt_of(None, None, "users")


@pytest.mark.parametrize("scope", ["tenant", "shared"])
@pytest.mark.parametrize("model", [BASE, "a2"])  # the base model and a public adapter
def test_tenants_get_their_own_salt_unless_shared(tokenizer, scope, model):
    resolver = AdapterResolver(FakeRegistry(), BASE, auth=True, admin_key="")
    front = Frontend(tokenizer, resolver, Dispatcher(), 64, scope)
    params = SamplingParams(max_tokens=2)
    salts = {
        key: prepare(front, model, (1, 2, 3), params, key).call.cache_salt for key in ("k1", "k2")
    }
    if scope == "tenant":
        assert salts == {"k1": "t1\x00", "k2": "t2\x00"}
    else:
        assert salts == {"k1": "", "k2": ""}
    salted = prepare(front, model, (1, 2, 3), params, "k1", cache_salt="s").call
    assert salted.cache_salt == ("t1\x00s" if scope == "tenant" else "\x00s")


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_rest_cache_salt_is_checked(model):
    base = (
        {"model": "a", "prompt": "x"}
        if model is CompletionRequest
        else {"model": "a", "messages": [{"role": "user", "content": "x"}]}
    )
    assert parse_body(model, {**base, "cache_salt": "user-7"}).cache_salt == "user-7"
    assert parse_body(model, {**base, "cache_salt": None}).cache_salt is None
    for bad, got in (("", "a string of 0 characters"), ("x" * 257, "a string of 257 characters")):
        with pytest.raises(InvalidRequest) as e:
            parse_body(model, {**base, "cache_salt": bad})
        assert (str(e.value), e.value.param) == (
            f"cache_salt: got {got}; allowed: null or a non-empty string of at most 256 characters",
            "cache_salt",
        )


def test_grpc_cache_salt():
    assert cache_salt_of_request(pb.GenerateRequest(model="m")) is None
    assert cache_salt_of_request(pb.GenerateRequest(model="m", cache_salt="u")) == "u"
    with pytest.raises(InvalidRequest, match="cache_salt: got a string of 257 characters"):
        cache_salt_of_request(pb.GenerateRequest(model="m", cache_salt="x" * 257))
