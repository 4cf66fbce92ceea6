"""Admission before any work on the body (router.admission), over a real Frontend and
tokenizer with a fake registry (limits included) and dispatch, on every route that runs
the tokenizer: a bad key or a tenant past its limit is refused without the tokenizer
running; a request counts once, whatever its prompts and n; the answers' precedence is
401 > 429 > 400 > 404; and admission costs the registry round trips it did before."""

import asyncio
import json
from collections import Counter

import grpc
import pytest

from router import rest, tokenize
from router.auth import AdapterResolver
from router.body_parse import parse_body
from router.frontend import Frontend
from router.grpc_service import GrpcInferenceMixin
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from router.proto import lorafleet_pb2 as pb
from router.rate_limit import TenantRateLimiter
from tests.unit.router.test_frontend_auth import BASE, Dispatcher, FakeRegistry, tokenizer
from tests.unit.router.test_status_mapping import FakeContext

__all__ = ["tokenizer"]  # the module fixture, shared
LIMIT = 3  # t1's requests per minute; t2 has no limit


class CountingTokenizer:
    """The test tokenizer, counting the calls that run it on a request's text or ids:
    the work a refused request must not cost."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __len__(self):
        return len(self.inner)

    def __deepcopy__(self, memo):
        return self  # the Frontend encodes with its own copy: count that copy's calls

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.calls += 1
        return self.inner.apply_chat_template(*args, **kwargs)

    def decode(self, *args, **kwargs):
        self.calls += 1
        return self.inner.decode(*args, **kwargs)


class LimitedRegistry(FakeRegistry):
    """FakeRegistry's tenants and adapters, with a budget of `limit` requests per tenant
    (no refill: the tests take no time), its checks and key lookups counted."""

    def __init__(self):
        super().__init__()
        self.checks: Counter[str] = Counter()  # admit_request calls
        self.admitted: Counter[str] = Counter()
        self.key_lookups = 0

    async def resolve_key(self, api_key):
        self.key_lookups += 1
        return await super().resolve_key(api_key)

    async def tenant_limit(self, tenant):
        return {"t1": LIMIT}.get(tenant, 0)

    async def admit_request(self, tenant, limit):
        self.checks[tenant] += 1
        if self.admitted[tenant] >= limit:
            return 20_000_000  # a refusal: the microseconds until one would be admitted
        self.admitted[tenant] += 1
        return 0


@pytest.fixture
def setup(tokenizer):
    """(front, counting tokenizer, registry), auth on, a context of 64 tokens."""
    registry, counting = LimitedRegistry(), CountingTokenizer(tokenizer)
    resolver = AdapterResolver(registry, BASE, auth=True, admin_key="")
    limiter = TenantRateLimiter(registry)
    return Frontend(counting, resolver, Dispatcher(), 64, rate_limiter=limiter), counting, registry


# Each route: (front, key, model, body_error) -> HTTP status (gRPC's code as its HTTP
# twin). body_error: a body that parses but is refused once tokenized (max_tokens past
# the context).
def completion(front, key, model, body_error, prompt="hello world", n=1):
    body = {"model": model, "prompt": prompt, "max_tokens": 1000 if body_error else 2, "n": n}
    req = parse_body(CompletionRequest, body)
    return asyncio.run(rest.completions(front, key, req)).status_code


def batch(front, key, model, body_error):
    return completion(front, key, model, body_error, ["hello", "world", "again"], n=2)


def chat(front, key, model, body_error):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1000 if body_error else 2,
    }
    req = parse_body(ChatCompletionRequest, body)
    return asyncio.run(rest.chat_completions(front, key, req)).status_code


def tokenizer_route(route, body):
    def call(front, key, model, body_error):
        raw = json.dumps(body | {"model": model}).encode()
        return asyncio.run(route(front, key, raw)).status_code

    return call


GRPC_HTTP = {
    None: 200,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.INTERNAL: 500,
}


def grpc_route(**fields):
    def call(front, key, model, body_error):
        ingress = GrpcInferenceMixin()
        ingress.frontend = front
        request = pb.GenerateRequest(model=model, max_tokens=1000 if body_error else 2, **fields)
        ctx = FakeContext([("authorization", f"Bearer {key}")] if key else [])

        async def go():
            try:
                _ = [chunk async for chunk in ingress.Generate(request, ctx)]
            except Exception:
                pass  # its status is on ctx

        asyncio.run(go())
        return GRPC_HTTP[ctx.code]

    return call


INFERENCE = {
    "completion": completion,
    "batch": batch,
    "chat": chat,
    "grpc": grpc_route(prompt="hello world"),
    "grpc_chat": grpc_route(messages=[pb.ChatTurn(role="user", content="hi")]),
}
ROUTES = INFERENCE | {
    "tokenize": tokenizer_route(tokenize.tokenize, {"prompt": "hello world"}),
    "tokenize_chat": tokenizer_route(
        tokenize.tokenize, {"messages": [{"role": "user", "content": "hi"}]}
    ),
    "detokenize": tokenizer_route(tokenize.detokenize, {"tokens": [5, 6]}),
}
# the tokenizer's runs of one admitted request: the batch encodes each of its 3 prompts
TOKENIZER_CALLS = {"batch": 3}


@pytest.mark.parametrize("key", [None, "bad"])
@pytest.mark.parametrize("route", ROUTES)
def test_a_bad_key_is_refused_before_the_tokenizer_runs(setup, route, key):
    front, counting, registry = setup
    assert ROUTES[route](front, key, "a1", False) == 401
    assert counting.calls == 0 and not registry.checks


@pytest.mark.parametrize("route", ROUTES)
def test_a_tenant_past_its_limit_is_refused_before_the_tokenizer_runs(setup, route):
    front, counting, registry = setup
    registry.admitted["t1"] = LIMIT
    assert ROUTES[route](front, "k1", "a1", False) == 429
    assert counting.calls == 0
    assert registry.checks == {"t1": 1}


@pytest.mark.parametrize("route", ROUTES)
def test_a_request_counts_once_whatever_its_prompts_and_n(setup, route):
    front, counting, registry = setup
    assert ROUTES[route](front, "k1", "a1", False) == 200
    assert registry.checks == registry.admitted == {"t1": 1}
    assert counting.calls == TOKENIZER_CALLS.get(route, 1)


@pytest.mark.parametrize(
    "key, past_limit, body_error, model, status",
    [
        ("bad", True, True, "nope", 401),  # a bad key learns only that
        ("k1", True, True, "nope", 429),
        ("k1", False, True, "nope", 400),  # a body error with a good key, as before
        ("k2", False, True, "a1", 400),  # ... for a forbidden adapter too
        ("k1", False, False, "nope", 404),
        ("k2", False, False, "a1", 404),  # forbidden: the same 404 as unknown
        ("k1", False, False, "gone", 404),  # draining: the same too
        ("k2", False, False, BASE, 200),
    ],
)
@pytest.mark.parametrize("route", INFERENCE)
def test_the_answers_precedence(setup, route, key, past_limit, body_error, model, status):
    front, _, registry = setup
    if past_limit:
        registry.admitted["t1"] = LIMIT
    assert INFERENCE[route](front, key, model, body_error) == status


@pytest.mark.parametrize(
    "key, model, resolves, key_lookups",
    [
        ("k1", "a1", 1, 0),  # key and adapter: one script
        ("k1", BASE, 0, 1),  # the base model: one key lookup
        ("k2", "a1", 1, 1),  # a 404: its tenant is looked up for the limit
        ("bad", "a1", 1, 0),
    ],
)
def test_admission_round_trips(setup, key, model, resolves, key_lookups):
    front, _, registry = setup
    completion(front, key, model, False)
    assert (registry.resolves, registry.key_lookups) == (resolves, key_lookups)


@pytest.mark.parametrize("key, status", [("bad", 401), ("k1", 400)])
def test_grpc_without_a_model_is_refused_after_the_key(setup, key, status):
    front, counting, _ = setup
    assert INFERENCE["grpc"](front, key, "", False) == status
    assert counting.calls == 0
