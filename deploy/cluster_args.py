"""The `args:` of a lorafleet Serve application (deploy/cluster.yaml), validated once.

`ClusterArgs` holds every field with its default, range and docstring, and the checks
across fields (`AutoscalingArgs` for `args.autoscaling`); `parse_args` turns the first
problem into one InvalidRequest naming the field. No Ray here: `deploy.run_cluster`
checks a config's args with it before `serve run` starts anything, and `deploy.builder`
builds the application from the validated args.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from cluster.client import check_url
from cluster.keys import Keys, check_name
from cluster.registry import MAX_LORA_RANK
from lora_core.errors import InvalidRequest
from replica.config import DENSE_PROMPT_MIN

LORA_POLICY = "cluster.autoscaling:LoraAutoscalingPolicy"
SERVE_METRICS_INTERVAL_S = 10.0  # Serve's default replica -> controller metrics push period


class AutoscalingArgs(BaseModel):
    """`args.autoscaling` of the config: the replica count follows request load and
    adapter-slot demand (cluster.autoscaling) between min_replicas and max_replicas."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(16.0, gt=0.0)
    """Running + queued requests per replica the fleet is sized for."""
    target_slot_use: float = Field(1.0, gt=0.0, le=1.0)
    """Fraction of the fleet's GPU adapter slots active adapters may fill before it grows."""
    kv_target: float = Field(0.9, gt=0.0, le=1.0)
    """Mean KV-cache use above which the fleet grows while requests wait."""
    upscale_delay_s: float = Field(10.0, ge=0.0)
    downscale_delay_s: float = Field(120.0, ge=0.0)
    look_back_period_s: float = Field(30.0, gt=0.0)
    """Window over which replica metrics are averaged (> metrics_interval_s)."""
    metrics_interval_s: float = Field(SERVE_METRICS_INTERVAL_S, gt=0.0)
    """How often replicas push their metrics to Serve's controller."""
    policy: Literal["lora", "default"] = "lora"
    """lora: LoraAutoscalingPolicy; default: Serve's queue-length policy (for comparison)."""

    @model_validator(mode="after")
    def _check(self) -> AutoscalingArgs:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas={self.max_replicas}; allowed: >= min_replicas ({self.min_replicas})"
            )
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(
                f"look_back_period_s={self.look_back_period_s}; allowed: > "
                f"metrics_interval_s ({self.metrics_interval_s})"
            )
        return self

    def serve_config(self) -> dict:
        """Serve's autoscaling_config for the replica deployment."""
        config = {
            "min_replicas": self.min_replicas,
            "initial_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "look_back_period_s": self.look_back_period_s,
        }
        if self.metrics_interval_s != SERVE_METRICS_INTERVAL_S:
            # Serve 2.60 still reads it as the push period but warns that it is deprecated,
            # so it is passed only when changed.
            config["metrics_interval_s"] = self.metrics_interval_s
        if self.policy == "lora":
            config["policy"] = {
                "policy_function": LORA_POLICY,
                "policy_kwargs": {
                    "target_slot_use": self.target_slot_use,
                    "kv_target": self.kv_target,
                },
            }
        return config


class ClusterArgs(BaseModel):
    """The `args:` of deploy/cluster.yaml (every field optional)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = "demo"
    """A local HF model directory, or "demo": generate the tiny demo model + adapters."""
    served_model_name: str = ""
    """The base model's id in `model` fields ("" = the model directory's name)."""
    redis_url: str = Field("", repr=False)  # may hold a password: kept out of reprs
    """The registry ("" = start a local redis-server on 127.0.0.1 for the cluster)."""
    redis_port: int | None = Field(None, ge=1, le=65535)
    """Port of that local redis-server (None = a free one)."""
    redis_data_dir: str = ""
    """An absolute directory (made if missing) where that local redis-server keeps the
    registry (AOF, fsync every second) and its password across cluster restarts ("" = in
    memory: what is registered goes when the Ray cluster stops)."""
    namespace: str = "lorafleet"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "auto"
    max_loras: int = Field(2, ge=1)
    max_cpu_loras: int = Field(4, ge=1)
    max_lora_rank: int = Field(64, ge=1, le=MAX_LORA_RANK)
    max_model_len: int = Field(0, ge=0)
    kv_cache_tokens: int = Field(16384, ge=16)
    max_num_seqs: int = Field(64, ge=1)
    """Sequences one replica's engine batches at most. A replica runs
    max_ongoing_requests requests at once (each choice of a request with n > 1 is one),
    so its batches hold at most that many sequences: raise both together on GPUs."""
    max_num_batched_tokens: int = Field(2048, ge=1)
    """Tokens one engine step runs at most, decode rows and prefill chunks together
    (a longer prompt prefills over several steps)."""
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True
    """On CUDA: replay decode steps from CUDA graphs, and prefill and mixed steps' layers
    from per-layer graphs around eager attention (tensor_parallel_size 1)."""
    dense_prompt_min: int = Field(DENSE_PROMPT_MIN, ge=0)
    """On CUDA: a whole prompt (nothing of it prefix-cached) of this many tokens or more
    attends through dense causal SDPA (cuDNN / FlashAttention) on its own keys instead of
    the paged-attention kernel, which is 1.5-2.6x slower on whole prompts of 512-8192
    tokens (`benchmarks/README.md`, "Paged attention"); 0 = every prompt paged."""
    kernel_warmup: bool = True
    """On CUDA with cuda_graphs: compile every graph key's Triton kernels at replica start
    (one eager forward per key) instead of in the first step to need each, where a cold
    compile stalls that step's requests ~1-2 s."""
    lora_stacked: bool = False
    """On GPUs: each LoRA layer's shrink inside its base GEMM (replica.config.EngineConfig,
    which refuses it with tensor_parallel_size > 1, before the cluster starts)."""
    auth: bool = False
    """Require tenant API keys (Authorization: Bearer ...) on inference requests."""
    prefix_cache_scope: Literal["tenant", "shared"] = "tenant"
    """With auth: "tenant" keeps each tenant's prefix-cache blocks to itself (another
    tenant cannot time whether a prompt is cached); "shared" lets tenants reuse each
    other's blocks of any model they may both use (the base model, public adapters,
    adapters granted to several; common system prompts computed once, at that privacy
    cost)."""
    admin_key: str = ""
    """Key of the admin endpoints ("" disables them)."""
    tenant_requests_per_minute: int = Field(0, ge=0)
    """With auth: requests per minute of a tenant without a limit of its own (`lorafleet
    tenants limit`): a burst of up to that many, then one every 60 s / it; past it, 429
    until the next request would be admitted (GCRA, `router.rate_limit`; 0 = no limit)."""
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "pythonic"] | None = None
    """How chat's tool_choice "auto" reads the calls a model writes (`router.tools.PARSERS`):
    "hermes" (<tool_call>{"name": ..., "arguments": {...}}</tool_call>, as Hermes, Qwen
    2.5 / 3 and the demo's template write them), "llama3_json" (an answer of {"name": ...,
    "parameters": {...}} objects: Llama 3.1 / 3.2), "mistral" ([TOOL_CALLS] then a JSON
    array of calls) or "pythonic" (an answer [f(a=1), g()]: Llama 3.2 / 4); None refuses
    "auto" with tools (named and "required" calls need no parser: a grammar forces them)."""
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = None
    """How chat splits a reasoning model's thinking (<think>...</think>) from its answer
    into `reasoning_content` (`router.reasoning`); None leaves it in `content`."""
    adapter_roots: tuple[str, ...] = ()
    """Absolute directories POST /v1/load_lora_adapter may register adapters from (their
    real paths, symlinks resolved; () = any absolute path). The admin CLI, which talks to
    Redis itself, is not restricted."""
    demo_cache_dir: str = ""
    """Where the demo is generated ("" = ~/.cache/lorafleet or $LORAFLEET_CACHE)."""
    register_demo_adapters: bool = True
    """With model "demo": register the demo adapters (public) in the registry."""
    router: Literal["affinity", "default"] = "affinity"
    """affinity: the LoRA-affinity router; default: Serve's power-of-two router with
    `@serve.multiplexed` adapter loading (the benchmark baseline)."""
    num_replicas: int = Field(2, ge=1)
    """A fixed replica count; leave unset when `autoscaling` is given."""
    autoscaling: AutoscalingArgs | None = None
    """Autoscale the replica deployment (None = num_replicas, fixed)."""
    num_cpus_per_replica: float = Field(0.5, ge=0.0)
    num_gpus_per_replica: float = Field(0.0, ge=0.0)
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one replica's base model is sharded over (Megatron-style tensor parallelism:
    the replica runs one worker process per further rank). On GPUs num_gpus_per_replica
    must equal it."""
    tp_step_timeout_s: float = Field(300.0, gt=0.0, allow_inf_nan=False)
    """With tensor_parallel_size > 1: a worker silent this long in one step fails the
    step and the replica's health check (Serve then replaces the replica)."""
    max_ongoing_requests: int = Field(32, ge=1)
    max_queued_requests: int = Field(256, ge=-1)
    """Requests waiting for a replica before 503 backpressure (-1 = unbounded)."""
    hot_queue_len: int = Field(8, ge=1)
    """Affinity router: when every holder of an adapter has this many queued requests,
    one more replica joins its set."""
    overload_queue_len: int = Field(32, ge=1)
    """Affinity router: holders with this many queued requests are skipped."""
    ingress_max_ongoing_requests: int = Field(1024, ge=1)
    """Concurrent requests one ingress replica handles (it only awaits replicas)."""
    max_request_bytes: int = Field(32 * 2**20, ge=1024)
    """Largest request body the ingress reads (413 beyond)."""
    routing_stats_period_s: float = Field(1.0, gt=0.0)
    registry_tick_s: float = Field(1.0, gt=0.0)
    lease_ttl_s: float = Field(5.0, ge=0.01, le=3600.0)
    """A replica's registry lease (the registry takes 0.01 .. 3600 s)."""
    metrics_max_models: int = Field(100, ge=0)
    """Adapters each replica's request counters name before counting the rest under
    model="(other)" (bounds the metrics' label cardinality)."""

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, ns: str) -> str:
        return Keys(ns).ns  # the registry's rule, checked before anything starts

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, url: str) -> str:
        return check_url(url) if url else url

    @field_validator("redis_data_dir")
    @classmethod
    def _redis_data_dir(cls, path: str) -> str:
        if path and not os.path.isabs(path):
            raise ValueError(f"{path!r} is relative; allowed: an absolute directory")
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"{path!r} is not a directory; allowed: a directory, or no file")
        return path

    @field_validator("served_model_name")
    @classmethod
    def _served_name(cls, name: str) -> str:
        return check_name("base model", name) if name else name

    @field_validator("adapter_roots")
    @classmethod
    def _adapter_roots(cls, roots: tuple[str, ...]) -> tuple[str, ...]:
        for root in roots:
            if not os.path.isabs(root):
                raise ValueError(f"{root!r} is relative; allowed: absolute directories")
        return roots

    @field_validator("max_queued_requests")
    @classmethod
    def _max_queued(cls, n: int) -> int:
        if n == 0:  # Serve's deployment refused it, as a traceback of build_app
            raise ValueError("0; allowed: -1 (unbounded) or a positive count")
        return n

    @field_validator("admin_key")
    @classmethod
    def _admin_key(cls, key: str) -> str:
        if key != key.strip():
            raise ValueError(
                "has leading or trailing whitespace, which a key read from an "
                "'Authorization: Bearer <key>' header never has; allowed: a key without it"
            )
        return key

    @model_validator(mode="after")
    def _check(self) -> ClusterArgs:
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras={self.max_cpu_loras}; allowed: >= max_loras ({self.max_loras})"
            )
        tp, gpus = self.tensor_parallel_size, self.num_gpus_per_replica
        if tp > 1 and gpus > 0 and gpus != tp:
            raise ValueError(
                f"num_gpus_per_replica={gpus:g} with tensor_parallel_size={tp}; allowed: "
                f"num_gpus_per_replica {tp} (one GPU per rank) or 0 (CPU)"
            )
        if self.redis_port is not None and self.redis_url:
            raise ValueError(
                f"redis_port={self.redis_port} with redis_url; allowed: redis_port only "
                "without redis_url (the port of the local redis-server started then)"
            )
        if self.redis_data_dir and self.redis_url:
            raise ValueError(
                f"redis_data_dir={self.redis_data_dir!r} with redis_url; allowed: redis_data_dir "
                "only without redis_url (the data directory of the local redis-server started then)"
            )
        if self.tenant_requests_per_minute and not self.auth:
            raise ValueError(
                f"tenant_requests_per_minute={self.tenant_requests_per_minute} without auth; "
                "allowed: a limit only with auth: true (without keys no request has a tenant)"
            )
        if self.hot_queue_len > self.overload_queue_len:
            raise ValueError("hot_queue_len must be <= overload_queue_len")
        if self.lease_ttl_s <= 2 * self.registry_tick_s:
            # a replica renews its lease once per tick, after the tick's work: a lease of
            # one or two ticks lapses on one late tick, and the replica leaves routing
            raise ValueError(
                f"lease_ttl_s={self.lease_ttl_s:g} with registry_tick_s="
                f"{self.registry_tick_s:g}; allowed: lease_ttl_s > 2 x registry_tick_s"
            )
        if self.autoscaling is not None:
            if "num_replicas" in self.model_fields_set:
                raise ValueError("num_replicas and autoscaling: set one of them, not both")
            target = self.autoscaling.target_ongoing_requests
            if target > self.max_ongoing_requests:
                default = "target_ongoing_requests" not in self.autoscaling.model_fields_set
                raise ValueError(
                    f"autoscaling.target_ongoing_requests={target:g}"
                    f"{' (its default)' if default else ''} exceeds max_ongoing_requests="
                    f"{self.max_ongoing_requests}; allowed: target_ongoing_requests <= "
                    "max_ongoing_requests (set either)"
                )
        return self


def parse_args(args: dict) -> ClusterArgs:
    """Validate the config's args; any problem -> InvalidRequest naming the field."""
    try:
        return ClusterArgs.model_validate(args or {})
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        msg = first["msg"].removeprefix("Value error, ")  # pydantic's wording, not ours
        where = f"{loc}: " if loc else ""  # model-level checks name their fields themselves
        raise InvalidRequest(f"cluster args: {where}{msg}") from None
