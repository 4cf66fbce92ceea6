"""Frontend + AdapterResolver against a fake registry and a fake dispatch (pure logic)."""

import asyncio
from dataclasses import dataclass

import pytest

from deploy.demo import build_tokenizer
from lora_core.errors import (
    AdapterDraining,
    AdapterNotFound,
    AdapterVersionUnavailable,
    CapacityExceeded,
    InvalidRequest,
    Unauthorized,
)
from lora_core.identity import AdapterRef
from replica.outputs import RequestOutput
from replica.sampling_params import SamplingParams
from router.auth import INVALID_KEY, AdapterResolver, NotBearer, bearer_key
from router.frontend import Frontend

BASE = "base"


def ref(name, version=1):
    return AdapterRef(name, version, "ab" * 32, f"/a/{name}", 8, BASE)


@dataclass
class Loc:
    replica: str
    tier: str
    pool: str = "mixed"


@dataclass
class Found:
    ref: AdapterRef
    tenant: str | None
    locations: tuple


@dataclass
class Rec:
    name: str
    owner: str
    public: bool
    state: str = "active"


class FakeRegistry:
    """Tenants t1 (key k1) and t2 (key k2); t1 owns a1, a2 is public, t2 is granted a3."""

    def __init__(self):
        self.keys = {"k1": "t1", "k2": "t2"}
        self.recs = {
            "a1": Rec("a1", "t1", False),
            "a2": Rec("a2", "", True),
            "a3": Rec("a3", "t1", False),
            "gone": Rec("gone", "", True, "draining"),
        }
        self.grants = {("t2", "a3")}
        self.versions = {"a1": 1}
        self.resolves = 0

    async def resolve_key(self, api_key):
        return self.keys.get(api_key)

    async def list_adapter_names(self):
        return sorted(self.recs)

    async def visible_adapters(self, tenant, names=None):
        # the rule of the registry's visible_adapters script (tested against Redis in
        # tests/integration/cluster/test_registry_visible.py)
        return sorted(
            (
                ref(r.name)
                for r in self.recs.values()
                if (names is None or r.name in names)
                and r.state == "active"
                and (
                    tenant is None
                    or r.public
                    or r.owner == tenant
                    or (tenant, r.name) in self.grants
                )
            ),
            key=lambda x: x.name,
        )

    async def resolve_request(self, api_key, model_name, *, auth):
        self.resolves += 1
        tenant = self.keys.get(api_key) if api_key else None
        if (auth or api_key is not None) and tenant is None:
            raise Unauthorized("missing or unknown API key")  # the real registry's wording
        rec = self.recs.get(model_name)
        if rec is None:
            raise AdapterNotFound(model_name)
        if auth and not (rec.public or rec.owner == tenant or (tenant, model_name) in self.grants):
            raise AdapterNotFound(model_name)
        if rec.state == "draining":
            raise AdapterDraining(model_name)
        version = self.versions.get(model_name, 1)
        return Found(ref(model_name, version), tenant, (Loc("r1", "gpu"), Loc("r2", "cpu")))


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize(
    "header, key",
    [
        ("Bearer abc", "abc"),
        ("bearer  abc ", "abc"),
        ("Basic abc", NotBearer("Basic")),
        ("Token  abc ", NotBearer("Token")),
        ("abc", NotBearer("")),  # a bare key: its text is never kept, so never echoed
        ("Bearer ", None),
        ("Bearer", None),
        ("  ", None),
        (None, None),
    ],
)
def test_bearer_key(header, key):
    got = bearer_key(header)
    assert (got, type(got)) == (key, type(key))


@pytest.mark.parametrize(
    "header, message",
    [
        (None, "missing API key; send 'Authorization: Bearer <key>'"),
        (
            "Token k1",
            "unsupported Authorization scheme 'Token'; send 'Authorization: Bearer <key>'",
        ),
        (
            "Basic azE6",
            "unsupported Authorization scheme 'Basic'; send 'Authorization: Bearer <key>'",
        ),
        ("k1", "the Authorization header names no scheme; send 'Authorization: Bearer <key>'"),
    ],
)
@pytest.mark.parametrize("model", ["a2", BASE])
def test_a_header_of_another_scheme_is_401_naming_it(header, message, model):
    resolver = AdapterResolver(FakeRegistry(), BASE, auth=True, admin_key="adm")
    for call in (resolver.resolve(bearer_key(header), model), resolver.tenant(bearer_key(header))):
        with pytest.raises(Unauthorized) as e:
            run(call)
        assert str(e.value) == message


ADMIN = "admin endpoints need 'Authorization: Bearer <admin key>'"


@pytest.mark.parametrize(
    "header, message",
    [
        (None, ADMIN),
        ("Bearer nope", ADMIN),
        ("Token adm", f"unsupported Authorization scheme 'Token'; {ADMIN}"),
        ("adm", f"the Authorization header names no scheme; {ADMIN}"),
    ],
)
def test_admin_refusals_name_another_scheme(header, message):
    resolver = AdapterResolver(FakeRegistry(), BASE, auth=False, admin_key="adm")
    with pytest.raises(Unauthorized) as e:
        resolver.check_admin(bearer_key(header))
    assert str(e.value) == message


class GrpcMetadata:
    """The part of Serve's gRPC context `grpc_api_key` reads."""

    def __init__(self, *pairs: tuple[str, str]):
        self.pairs = pairs

    def invocation_metadata(self):
        return self.pairs


@pytest.mark.parametrize("header", ["Token k1", "Bearer k1", "k1"])
def test_grpc_reads_the_authorization_metadata_as_rest_reads_the_header(header):
    from router.grpc_service import grpc_api_key

    got = grpc_api_key(GrpcMetadata(("x-other", "1"), ("Authorization", header)))
    assert (got, type(got)) == (bearer_key(header), type(bearer_key(header)))


def test_with_auth_off_a_header_of_another_scheme_is_ignored():
    resolver = AdapterResolver(FakeRegistry(), BASE, auth=False, admin_key="")
    assert run(resolver.resolve(bearer_key("Token k1"), "a2")).adapter == ref("a2")
    assert run(resolver.tenant(bearer_key("Basic azE6"))) is None


# key x adapter -> expected outcome with auth on
AUTH_MATRIX = [
    (None, "a1", Unauthorized),
    ("bad", "a1", Unauthorized),
    ("k1", "a1", "ok"),
    ("k1", "a2", "ok"),
    ("k1", "a3", "ok"),
    ("k2", "a1", AdapterNotFound),
    ("k2", "a2", "ok"),
    ("k2", "a3", "ok"),
    ("k2", "nope", AdapterNotFound),
    ("k1", "gone", AdapterNotFound),
    ("k1", BASE, "ok"),
    ("bad", BASE, Unauthorized),
    (None, BASE, Unauthorized),
]


@pytest.mark.parametrize("key, model, expected", AUTH_MATRIX)
def test_auth_matrix(key, model, expected):
    resolver = AdapterResolver(FakeRegistry(), BASE, auth=True, admin_key="adm")
    if expected == "ok":
        got = run(resolver.resolve(key, model))
        assert got.adapter == (None if model == BASE else ref(model))
    else:
        with pytest.raises(expected):
            run(resolver.resolve(key, model))


@pytest.mark.parametrize("model", [BASE, "a1", "nope"])
def test_a_bad_key_gets_one_message_for_every_model(model):
    resolver = AdapterResolver(FakeRegistry(), BASE, auth=True, admin_key="")
    with pytest.raises(Unauthorized) as e:
        run(resolver.resolve("bad", model))
    assert str(e.value) == INVALID_KEY
    with pytest.raises(Unauthorized) as e:
        run(resolver.visible_adapters("bad"))
    assert str(e.value) == INVALID_KEY


@pytest.mark.parametrize("auth, key", [(False, None), (True, "k1"), (True, "k2")])
def test_a_draining_adapter_answers_exactly_like_an_unknown_one(auth, key):
    resolver = AdapterResolver(FakeRegistry(), BASE, auth=auth, admin_key="")
    with pytest.raises(AdapterNotFound) as gone:
        run(resolver.resolve(key, "gone"))
    with pytest.raises(AdapterNotFound) as unknown:
        run(resolver.resolve(key, "nope"))
    assert str(gone.value) == str(AdapterNotFound("gone"))
    assert str(unknown.value) == str(AdapterNotFound("nope"))


def test_auth_off_resolves_everything_and_carries_residency():
    resolver = AdapterResolver(FakeRegistry(), BASE, auth=False, admin_key="")
    got = run(resolver.resolve(None, "a1"))
    assert got.adapter == ref("a1")
    # Any key is ignored (the fake registry, like the real one, refuses unknown keys).
    assert run(resolver.resolve("whatever", "a1")).adapter == ref("a1")
    assert got.residency == (("r1", "gpu"), ("r2", "cpu"))
    assert run(resolver.resolve(None, BASE)).adapter is None


@pytest.mark.parametrize(
    "auth, key, names",
    [
        (False, None, ["a1", "a2", "a3"]),
        (True, "k1", ["a1", "a2", "a3"]),
        (True, "k2", ["a2", "a3"]),
    ],
)
def test_visible_adapters_per_tenant(auth, key, names):
    resolver = AdapterResolver(FakeRegistry(), BASE, auth=auth, admin_key="")
    assert [r.name for r in run(resolver.visible_adapters(key))] == names


def test_admin_key_check():
    resolver = AdapterResolver(FakeRegistry(), BASE, auth=False, admin_key="adm")
    resolver.check_admin("adm")
    for bad in (None, "k1", "adm2", "caf\xe9", "\u00e4dm"):  # non-ASCII: 401, not a 500
        with pytest.raises(Unauthorized):
            resolver.check_admin(bad)
    with pytest.raises(Unauthorized, match="disabled"):
        AdapterResolver(FakeRegistry(), BASE, auth=False, admin_key="").check_admin("adm")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d)
    return AutoTokenizer.from_pretrained(str(d))


class Dispatcher:
    """Yields scripted outputs; `fail` maps attempt number -> exception raised first."""

    def __init__(self, fail=None, fail_after_first=False):
        self.calls = []
        self.fail = fail or {}
        self.fail_after_first = fail_after_first

    async def __call__(self, call):
        self.calls.append(call)
        n = len(self.calls)
        if n in self.fail and not self.fail_after_first:
            raise self.fail[n]
        yield RequestOutput(call.request_id, [5], "x", num_prompt_tokens=2, num_output_tokens=1)
        if n in self.fail:
            raise self.fail[n]
        yield RequestOutput(call.request_id, [6], "y", finish_reason="length", num_output_tokens=2)


def collect(front, key, prepared):
    async def go():
        return [o async for o in front.generate(key, prepared)]

    return run(go())


def prepare(front, model, ids, params, key=None, **fields):
    """front.prepare of one prompt of a request `front` admitted."""
    return front.prepare(run(front.admit(key, model)), ids, params, **fields)


def make_front(tokenizer, dispatch, registry=None, max_len=64):
    resolver = AdapterResolver(registry or FakeRegistry(), BASE, auth=False, admin_key="")
    return Frontend(tokenizer, resolver, dispatch, max_len)


def test_encode_prompt_matches_the_tokenizer_and_checks_ids(tokenizer):
    front = make_front(tokenizer, Dispatcher())
    assert run(front.encode_prompt("hello world")) == tuple(tokenizer("hello world").input_ids)
    assert run(front.encode_prompt([1, 2])) == (1, 2)
    with pytest.raises(InvalidRequest, match="out of range"):
        run(front.encode_prompt([1, len(tokenizer)]))
    with pytest.raises(InvalidRequest, match="empty"):
        run(front.encode_prompt(""))


def test_encode_chat_uses_the_template(tokenizer):
    front = make_front(tokenizer, Dispatcher())
    ids = run(front.encode_chat([{"role": "user", "content": "hi"}]))
    assert tokenizer.decode(list(ids)) == "<|user|>hi<|end|><|assistant|>"


def test_prepare_checks_length_and_resolves(tokenizer):
    front = make_front(tokenizer, Dispatcher(), max_len=10)
    with pytest.raises(InvalidRequest, match="at most 10"):
        prepare(front, "a1", (1, 2, 3), SamplingParams(max_tokens=8))
    p = prepare(front, "a1", (1, 2, 3), SamplingParams(max_tokens=7))
    assert p.call.adapter == ref("a1") and p.call.prompt_token_ids == (1, 2, 3)
    assert p.call.residency == (("r1", "gpu"), ("r2", "cpu"))


def test_version_refusal_is_retried_once_with_a_fresh_resolution(tokenizer):
    registry = FakeRegistry()
    dispatch = Dispatcher(fail={1: AdapterVersionUnavailable("stale")})
    front = make_front(tokenizer, dispatch, registry)
    p = prepare(front, "a1", (1, 2), SamplingParams(max_tokens=2))
    registry.versions["a1"] = 2
    outs = collect(front, None, p)
    assert [o.new_text for o in outs] == ["x", "y"]
    assert [c.adapter.version for c in dispatch.calls] == [1, 2]
    assert registry.resolves == 2


def test_second_version_refusal_surfaces(tokenizer):
    err = AdapterVersionUnavailable("stale")
    front = make_front(tokenizer, Dispatcher(fail={1: err, 2: err}))
    p = prepare(front, "a1", (1, 2), SamplingParams(max_tokens=2))
    with pytest.raises(AdapterVersionUnavailable):
        collect(front, None, p)


def test_errors_after_the_first_output_are_not_retried(tokenizer):
    dispatch = Dispatcher(fail={1: AdapterVersionUnavailable("x")}, fail_after_first=True)
    front = make_front(tokenizer, dispatch)
    p = prepare(front, "a1", (1, 2), SamplingParams(max_tokens=2))
    with pytest.raises(AdapterVersionUnavailable):
        collect(front, None, p)
    assert len(dispatch.calls) == 1


def test_a_replica_refusing_a_draining_adapter_answers_not_found(tokenizer):
    dispatch = Dispatcher(fail={1: AdapterDraining("a1")})
    front = make_front(tokenizer, dispatch)
    p = prepare(front, "a1", (1, 2), SamplingParams(max_tokens=2))
    with pytest.raises(AdapterNotFound) as e:
        collect(front, None, p)
    assert str(e.value) == str(AdapterNotFound("a1"))
    assert len(dispatch.calls) == 1


def test_draining_after_the_first_output_is_not_rewritten(tokenizer):
    dispatch = Dispatcher(fail={1: AdapterDraining("a1")}, fail_after_first=True)
    front = make_front(tokenizer, dispatch)
    p = prepare(front, "a1", (1, 2), SamplingParams(max_tokens=2))
    with pytest.raises(AdapterDraining):
        collect(front, None, p)


def test_other_errors_pass_through_unretried(tokenizer):
    dispatch = Dispatcher(fail={1: CapacityExceeded("full")})
    front = make_front(tokenizer, dispatch)
    p = prepare(front, "a1", (1, 2), SamplingParams(max_tokens=2))
    with pytest.raises(CapacityExceeded):
        collect(front, None, p)
    assert len(dispatch.calls) == 1


def test_closing_the_outputs_closes_the_dispatch_at_once(tokenizer):
    """A client that leaves aborts its engine request when the response is closed, not
    when the garbage collector finds the replica call."""
    ended = []

    async def dispatch(call):
        try:
            yield RequestOutput(call.request_id, [5], "x", num_prompt_tokens=2)
            await asyncio.Event().wait()
        finally:
            ended.append(call.request_id)

    front = make_front(tokenizer, dispatch)
    p = prepare(front, "a1", (1, 2), SamplingParams(max_tokens=2))

    async def go():
        outputs = front.generate(None, p)
        await anext(outputs)
        await outputs.aclose()
        return list(ended)

    assert run(go()) == [p.call.request_id]
