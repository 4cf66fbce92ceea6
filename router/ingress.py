"""The ingress deployment: OpenAI REST (FastAPI) + gRPC, a thin shell over `Frontend`.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (and
/v1/models/{model}), GET /health, and the
admin endpoints (admin key required) POST /v1/load_lora_adapter,
/v1/unload_lora_adapter, /v1/pin_lora_adapter, /v1/unpin_lora_adapter,
/v1/warm_lora_adapter. Requests go to the replica deployment's handle, whose
LoRA-affinity request router picks the replica.
"""

# No `from __future__ import annotations` here: FastAPI must see the real `Request`
# annotation of the routes to inject the request.
import asyncio
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from lora_core.errors import CapacityExceeded, InvalidRequest, ReplicaFailed, RequestTooLarge
from replica.models.config import max_positions, resolve_max_model_len
from replica.outputs import RequestOutput
from replica.serve_protocol import GenerateCall
from router import admin, rest, tokenize
from router.admin import SERVED_REPUBLISH_S, keep_served_published
from router.admin_bodies import (
    AdapterNameRequest,
    LoadAdapterRequest,
    UnloadAdapterRequest,
    WarmAdapterRequest,
)
from router.auth import AdapterResolver, bearer_key
from router.body_parse import param_of_check, parse_request
from router.errors import unwrap
from router.frontend import Frontend
from router.grpc_service import GrpcInferenceMixin
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from router.openai_responses import model_card
from router.rate_limit import TenantRateLimiter
from router.serve_logs import install_client_error_filter

MAX_REQUEST_BYTES = 32 * 2**20


@dataclass(frozen=True)
class IngressSettings:
    """model_dir: the base model directory (the tokenizer is loaded from it).
    served_model_name: the base model's id in `model`. redis_url / namespace: the
    registry. auth: require tenant API keys. admin_key: key of the admin endpoints
    ("" disables them). adapter_roots: where the load endpoint may register adapters
    from (`router.admin.check_adapter_path`; () = anywhere). prefix_cache_scope:
    "tenant" or "shared" (`router.prepared.cache_salt_of`). max_model_len: prompt +
    output tokens per request at most (0 = the model's context length:
    `replica.models.config.max_positions`).
    max_lora_rank: the replicas' largest adapter rank (registration refuses larger).
    max_loras: the replicas' GPU adapter slots; published with the base model so that
    the registry refuses a pin that would leave no evictable slot (None: not published,
    pins are not checked).
    served_republish_s: seconds between re-publications of the served base model (so a
    Redis restarted empty gets it back). max_request_bytes: the largest request body
    read (a larger one is a 413, refused by its Content-Length before it is read, or
    as soon as a body streamed without one passes the limit). tool_call_parser: how
    chat's tool_choice "auto" reads calls (`router.tools.PARSERS`; None refuses "auto").
    reasoning_parser: how chat splits thinking into reasoning_content (None: not).
    tenant_requests_per_minute: with auth, the request rate limit of tenants without one
    of their own (`lorafleet tenants limit`; 0 = none; `router.rate_limit`)."""

    model_dir: str
    served_model_name: str
    redis_url: str = field(repr=False)  # may hold a password: kept out of reprs
    namespace: str = "lorafleet"
    auth: bool = False
    admin_key: str = ""
    prefix_cache_scope: str = "tenant"
    adapter_roots: tuple[str, ...] = ()
    max_model_len: int = 0
    max_lora_rank: int = 64
    max_loras: int | None = None
    served_republish_s: float = SERVED_REPUBLISH_S
    max_request_bytes: int = MAX_REQUEST_BYTES
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    tenant_requests_per_minute: int = 0


def model_max_len(model_dir: str, configured: int) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return resolve_max_model_len(configured, max_positions(cfg))


REPLICA_DEATH_RETRIES = 1


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, at most `limit` bytes; RequestTooLarge (413) beyond: without
    a bound, one client's gigabyte body was held in the ingress's memory whole."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit, "at least ")
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int, bound: str = "") -> RequestTooLarge:
    return RequestTooLarge(
        f"body: {bound}{size} bytes; allowed: at most {limit} bytes (max_request_bytes)", "body"
    )


def _key(request: Request) -> str | None:
    return bearer_key(request.headers.get("authorization"))


def _remote_as_its_own_request(handle: DeploymentHandle, call: GenerateCall):
    """handle.remote(call) under a Serve internal request id of its own.

    Every handle call made while serving one HTTP or gRPC request inherits that
    request's internal id, and Ray Serve's request router (2.60) indexes the calls
    waiting for a replica by it: a second call of the same request waiting at the same
    time is never assigned, so the n choices of one request hung. The cost: Serve's own
    recursive cancel of a request's children keys on that id too, which lorafleet does
    not need, since cancelling or closing a call in `_call_replica` cancels it.
    """
    ctx = serve.context._get_serve_request_context()
    own = dataclasses.replace(ctx, _internal_request_id=f"{call.request_id}-{uuid.uuid4().hex}")
    token = serve.context._serve_request_context.set(own)
    try:
        return handle.remote(call)  # reads the context now, synchronously
    finally:
        serve.context._serve_request_context.reset(token)


# Helpers the routes use are defined above the class: Serve pickles the ingress
# class by value when it is built, capturing the globals that exist at that point.
# No /openapi.json: it would list the admin endpoints to anyone, without a key.
app = FastAPI(title="lorafleet", docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(StarletteHTTPException)
async def _route_error(request: Request, exc: StarletteHTTPException) -> Response:
    headers = dict(exc.headers or {})
    return rest.route_error_response(request.method, request.url.path, exc.status_code, headers)


@app.exception_handler(Exception)
async def _unexpected_error(request: Request, exc: Exception) -> Response:
    """Anything a route did not answer itself: the OpenAI error JSON from the error table
    (a 500 naming only the error's type), not Starlette's plain-text 500."""
    return rest.error_response(exc)


@serve.deployment(name="Ingress")
@serve.ingress(app)
class LoraIngress(GrpcInferenceMixin):
    """OpenAI REST + gRPC front door of the cluster."""

    async def __init__(self, replicas: DeploymentHandle, settings: IngressSettings):
        from transformers import AutoTokenizer

        install_client_error_filter()  # gRPC refusals: one INFO line, as REST's

        from cluster.records import ServedBase

        self.served = ServedBase.from_model_dir(
            settings.served_model_name,
            settings.model_dir,
            settings.max_lora_rank,
            settings.max_loras,
        )
        registry = None
        self._served_task: asyncio.Task | None = None
        if settings.redis_url:
            from cluster.registry import AsyncRegistry

            registry = AsyncRegistry(
                settings.redis_url, settings.namespace, max_lora_rank=settings.max_lora_rank
            )
            # Published for `lorafleet adapters register`, which checks adapters against it,
            # and for `pin` (CLI and /v1/pin_lora_adapter), which checks max_loras.
            await admin.publish_served(registry, self.served)
            self._served_task = asyncio.get_running_loop().create_task(
                keep_served_published(registry, self.served, settings.served_republish_s)
            )
        self.registry = registry
        self.replicas = replicas
        self.adapter_roots = settings.adapter_roots
        self.max_request_bytes = settings.max_request_bytes
        resolver = AdapterResolver(
            registry, settings.served_model_name, settings.auth, settings.admin_key
        )
        limiter = None
        if registry is not None and settings.auth:  # without auth no request has a tenant
            limiter = TenantRateLimiter(registry, settings.tenant_requests_per_minute)
        tokenizer = AutoTokenizer.from_pretrained(settings.model_dir)
        max_len = model_max_len(settings.model_dir, settings.max_model_len)
        self.frontend = Frontend(
            tokenizer,
            resolver,
            self._dispatch,
            max_len,
            settings.prefix_cache_scope,
            settings.tool_call_parser,
            settings.reasoning_parser,
            rate_limiter=limiter,
        )

    async def __del__(self) -> None:
        if self._served_task is not None:
            self._served_task.cancel()

    async def _dispatch(self, call: GenerateCall) -> AsyncIterator[RequestOutput]:
        """One replica call; a replica that dies before the first output is retried once.
        One that dies later (or again) is a ReplicaFailed (503, retryable), not an internal
        error: outputs may have gone out, so only the caller can decide to start again."""
        for attempt in range(REPLICA_DEATH_RETRIES + 1):
            started = False
            try:
                # closing this generator closes the replica call now (its finally cancels
                # it), not whenever the garbage collector finds the call
                async with aclosing(self._call_replica(call)) as outputs:
                    async for out in outputs:
                        started = True
                        yield out
                return
            except (ActorDiedError, ActorUnavailableError) as e:
                if started or attempt == REPLICA_DEATH_RETRIES:
                    raise ReplicaFailed(
                        f"the replica running request {call.request_id} stopped "
                        f"({type(e).__name__}) while running it; allowed: send the request "
                        "again (another replica takes it)"
                    ) from None

    async def _call_replica(self, call: GenerateCall) -> AsyncIterator[RequestOutput]:
        handle = self.replicas.options(
            stream=True, method_name="generate", multiplexed_model_id=call.adapter_key or ""
        )
        gen = _remote_as_its_own_request(handle, call)
        ended = False
        try:
            async for out in gen:
                yield out
            ended = True
        except Exception as e:
            ended = True  # the call is over; cancel() would only re-raise its error
            # Serve may deliver backpressure wrapped (e.g. in a RayTaskError): look inside.
            if isinstance(unwrap(e), BackPressureError):
                raise CapacityExceeded(
                    f"all replicas are at their queue limit ({unwrap(e)})"
                ) from None
            raise
        finally:
            if not ended:  # the consumer left early: stop the replica's generation
                gen.cancel()

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        try:
            req = await parse_request(CompletionRequest, await self._body(request))
        except InvalidRequest as e:
            return await rest.refusal(self.frontend, _key(request), e)
        return await rest.completions(self.frontend, _key(request), req)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        try:
            req = await parse_request(ChatCompletionRequest, await self._body(request))
        except InvalidRequest as e:
            return await rest.refusal(self.frontend, _key(request), e)
        return await rest.chat_completions(self.frontend, _key(request), req)

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        resolver = self.frontend.resolver
        try:
            refs = await resolver.visible_adapters(_key(request))
        except Exception as e:
            return rest.error_response(e)
        base = resolver.base_name
        data = [model_card(base, None, "lorafleet")]
        data += [model_card(r.name, base, "lorafleet") for r in refs]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(self, model: str, request: Request) -> Response:
        """OpenAI's retrieve: the card of one model the caller may use; an unknown,
        forbidden or draining one is the same 404 as on the inference routes."""
        resolver = self.frontend.resolver
        try:
            resolved = await resolver.resolve(_key(request), model)
        except Exception as e:
            return rest.error_response(e)
        parent = None if resolved.adapter is None else resolver.base_name
        return JSONResponse(model_card(model, parent, "lorafleet"))

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        """vLLM's tokenizer route (`router.tokenize`)."""
        return await self._tokenizer_route(request, tokenize.tokenize)

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        """vLLM's detokenizer route (`router.tokenize`)."""
        return await self._tokenizer_route(request, tokenize.detokenize)

    async def _tokenizer_route(self, request: Request, route) -> Response:
        """route(frontend, key, body), or the refusal of a body over the limit."""
        try:
            body = await self._body(request)
        except InvalidRequest as e:
            return await rest.refusal(self.frontend, _key(request), e)
        return await route(self.frontend, _key(request), body)

    @app.get("/health")
    async def health(self) -> Response:
        """vLLM's liveness route (no key needed): 200 while this ingress answers."""
        return Response(status_code=200)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        async def act(req: LoadAdapterRequest):
            return await admin.load_adapter(self.registry, self.served, req, self.adapter_roots)

        return await self._admin(request, LoadAdapterRequest, act)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        async def act(req: UnloadAdapterRequest):
            return {
                "lora_name": req.lora_name,
                "state": await self.registry.unregister_adapter(req.lora_name),
            }

        return await self._admin(request, UnloadAdapterRequest, act)

    @app.post("/v1/pin_lora_adapter")
    async def pin_lora_adapter(self, request: Request) -> Response:
        async def act(req: AdapterNameRequest):
            await self.registry.pin(req.lora_name)
            return {"lora_name": req.lora_name, "pinned": True}

        return await self._admin(request, AdapterNameRequest, act)

    @app.post("/v1/unpin_lora_adapter")
    async def unpin_lora_adapter(self, request: Request) -> Response:
        async def act(req: AdapterNameRequest):
            return await admin.unpin_adapter(self.registry, req.lora_name)

        return await self._admin(request, AdapterNameRequest, act)

    @app.post("/v1/warm_lora_adapter")
    async def warm_lora_adapter(self, request: Request) -> Response:
        async def act(req: WarmAdapterRequest):
            await self.registry.warm(req.lora_name, req.replicas)
            return {"lora_name": req.lora_name, "warm_replicas": req.replicas}

        return await self._admin(request, WarmAdapterRequest, act)

    async def _body(self, request: Request) -> bytes:
        return await read_body(request, self.max_request_bytes)

    async def _admin(self, request: Request, model, act) -> Response:
        try:
            self.frontend.resolver.check_admin(_key(request))
            req = await parse_request(model, await self._body(request))
            if self.registry is None:
                raise InvalidRequest("admin endpoints need a registry (redis_url)")
            return JSONResponse(await act(req))
        except ValueError as e:  # the registry's name/choice/range checks
            return rest.error_response(InvalidRequest(str(e), param_of_check(str(e))))
        except Exception as e:
            return rest.error_response(admin.name_at_fault(e))
