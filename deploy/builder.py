"""The Serve application builder: `import_path: deploy.builder:build_app` in cluster.yaml.

`build_app(args)` validates the `args:` of the config once (`ClusterArgs`, in
deploy/cluster_args.py), prepares the model (the generated demo when `model: demo`), the
registry (a local redis-server when `redis_url` is empty), the demo adapters'
registration and the Grafana dashboard (deploy/dashboard.py), then binds ingress ->
replica deployment with the LoRA-affinity request router (and the LoRA autoscaling
policy when `autoscaling` is set).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.client import redact
from cluster.keys import check_name
from cluster.records import ServedBase
from deploy.cluster_args import ClusterArgs, parse_args  # importable from here too
from deploy.dashboard import install_dashboard
from deploy.model_checks import check_model_fits
from lora_core.errors import (
    AdapterAlreadyExists,
    AdapterNotFound,
    InvalidRequest,
    RegistryUnavailable,
)
from replica.config import EngineConfig
from replica.deployment import ReplicaDeployment, ReplicaSettings
from router.ingress import IngressSettings, LoraIngress
from router.serve_logs import ClientErrorFilter

AFFINITY_ROUTER = "router.request_router:LoraAffinityRouter"
DEFAULT_ROUTER = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"


def prepare_model(args: ClusterArgs) -> tuple[str, dict[str, Path]]:
    """(model directory, demo adapters by name) for args.model."""
    if args.model != "demo":
        if not (Path(args.model) / "config.json").is_file():
            raise InvalidRequest(
                f"model={args.model!r}: no config.json; allowed: a model directory or 'demo'"
            )
        return args.model, {}
    from deploy.demo import ensure_demo

    assets = ensure_demo(Path(args.demo_cache_dir) if args.demo_cache_dir else None)
    return str(assets.model_dir), dict(assets.adapters)


def served_model_name(cfg: ClusterArgs, model_dir: str) -> str:
    """The base model's id in requests: served_model_name, else the directory's name
    (InvalidRequest when that is no valid id: the ingress would refuse it at start)."""
    if cfg.served_model_name:
        return cfg.served_model_name
    name = Path(model_dir).name
    try:
        return check_name("base model", name)
    except ValueError as e:
        allowed = str(e).split("allowed: ", 1)[1]  # the registry's rule, in its words
        raise InvalidRequest(
            f"cluster args: served_model_name: the model directory's name {name!r} is not a "
            f"valid model id; allowed: {allowed} (set served_model_name)"
        ) from None


def register_demo(
    redis_url: str, namespace: str, adapters: dict[str, Path], served: ServedBase
) -> None:
    """Register each demo adapter (public) unless a version of it exists already."""
    from cluster.registry import Registry

    registry = Registry(redis_url, namespace, max_lora_rank=served.max_lora_rank)
    try:
        for name, path in sorted(adapters.items()):
            try:
                registry.register_adapter(name, str(path), public=True, served=served)
            except AdapterAlreadyExists:
                pass
    finally:
        registry.close()


def refuse_shadowed_adapter(redis_url: str, namespace: str, base_name: str) -> None:
    """Refuse, before anything starts, to serve the base model under the id of a registered
    adapter (AdapterAlreadyExists). The ingress's publish is the atomic check; without this
    one the refusal came as a traceback of every ingress start Serve retried. A registry
    that does not answer is left to the ingress's own check."""
    from cluster import ops
    from cluster.registry import Registry

    registry = Registry(redis_url, namespace)
    try:
        state = registry.get_adapter(base_name).state
    except (AdapterNotFound, RegistryUnavailable):
        return
    finally:
        registry.close()
    raise ops.served_shadows(base_name, state)


def local_registry(cfg: ClusterArgs) -> str:
    """The URL of the cluster's local redis-server (started on first use), announced on
    stderr: operators need it for the admin CLI (its port is picked at start unless
    redis_port is set). Its password goes to no log; the line names the file holding the
    whole URL, which only the cluster's user may read."""
    from deploy.local_redis import ensure_local_redis, local_redis_url_file

    redis_url = ensure_local_redis(cfg.redis_port, cfg.redis_data_dir)
    url_file = shlex.quote(local_redis_url_file())
    print(
        f"lorafleet: local registry at {redact(redis_url)} "
        f'(export LORAFLEET_REDIS_URL="$(cat {url_file})")',
        file=sys.stderr,
        flush=True,
    )
    return redis_url


def build_app(args: dict) -> serve.Application:
    """The Serve app for cluster.yaml's args (see ClusterArgs)."""
    cfg = parse_args(args)
    model_dir, demo_adapters = prepare_model(cfg)
    check_model_fits(engine_config(cfg, model_dir))  # before anything starts
    redis_url = cfg.redis_url or local_registry(cfg)
    refuse_shadowed_adapter(redis_url, cfg.namespace, served_model_name(cfg, model_dir))
    if demo_adapters and cfg.register_demo_adapters:
        served = ServedBase.from_model_dir(
            served_model_name(cfg, model_dir), model_dir, cfg.max_lora_rank
        )
        register_demo(redis_url, cfg.namespace, demo_adapters, served)
    installed = install_dashboard()
    if installed is not None:
        print(f"lorafleet: Grafana dashboard at {installed}", file=sys.stderr, flush=True)
    return bind_app(cfg, model_dir, redis_url)


def engine_config(cfg: ClusterArgs, model_dir: str) -> EngineConfig:
    """The replicas' engine config."""
    return EngineConfig(
        model=model_dir,
        dtype=cfg.dtype,
        device=cfg.device,
        max_loras=cfg.max_loras,
        max_cpu_loras=cfg.max_cpu_loras,
        max_lora_rank=cfg.max_lora_rank,
        max_model_len=cfg.max_model_len,
        kv_cache_tokens=cfg.kv_cache_tokens,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        enable_prefix_caching=cfg.enable_prefix_caching,
        cuda_graphs=cfg.cuda_graphs,
        lora_stacked=cfg.lora_stacked,
        dense_prompt_min=cfg.dense_prompt_min,
        kernel_warmup=cfg.kernel_warmup,
        tensor_parallel_size=cfg.tensor_parallel_size,
        tp_step_timeout_s=cfg.tp_step_timeout_s,
    )


def bind_app(cfg: ClusterArgs, model_dir: str, redis_url: str) -> serve.Application:
    base_name = served_model_name(cfg, model_dir)
    engine = engine_config(cfg, model_dir)
    replica = ReplicaSettings(
        engine=engine,
        redis_url=redis_url,
        namespace=cfg.namespace,
        registry_tick_s=cfg.registry_tick_s,
        lease_ttl_s=cfg.lease_ttl_s,
        metrics_max_models=cfg.metrics_max_models,
        served_model_name=base_name,
        log_filters=(ClientErrorFilter(),),
    )
    router = RequestRouterConfig(
        request_router_class=AFFINITY_ROUTER if cfg.router == "affinity" else DEFAULT_ROUTER,
        request_router_kwargs=(
            {"hot_queue_len": cfg.hot_queue_len, "overload_queue_len": cfg.overload_queue_len}
            if cfg.router == "affinity"
            else {}
        ),
        request_routing_stats_period_s=cfg.routing_stats_period_s,
        request_routing_stats_timeout_s=max(1.0, cfg.routing_stats_period_s * 3),
    )
    deployment = ReplicaDeployment
    if cfg.router == "default":
        from replica.serve_multiplexed import multiplexed_deployment

        deployment = multiplexed_deployment(cfg.max_loras)
    if cfg.autoscaling is not None:
        scaling = {"autoscaling_config": cfg.autoscaling.serve_config()}
    else:
        scaling = {"num_replicas": cfg.num_replicas}
    replicas = deployment.options(
        **scaling,
        max_ongoing_requests=cfg.max_ongoing_requests,
        max_queued_requests=cfg.max_queued_requests,
        ray_actor_options={
            "num_cpus": cfg.num_cpus_per_replica,
            "num_gpus": cfg.num_gpus_per_replica,
        },
        request_router_config=router,
    ).bind(replica)
    ingress = IngressSettings(
        model_dir=model_dir,
        served_model_name=base_name,
        redis_url=redis_url,
        namespace=cfg.namespace,
        auth=cfg.auth,
        admin_key=cfg.admin_key,
        adapter_roots=cfg.adapter_roots,
        prefix_cache_scope=cfg.prefix_cache_scope,
        max_model_len=cfg.max_model_len,
        max_lora_rank=cfg.max_lora_rank,
        max_loras=cfg.max_loras,
        max_request_bytes=cfg.max_request_bytes,
        tool_call_parser=cfg.tool_call_parser,
        reasoning_parser=cfg.reasoning_parser,
        tenant_requests_per_minute=cfg.tenant_requests_per_minute,
    )
    return LoraIngress.options(
        ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=cfg.ingress_max_ongoing_requests
    ).bind(replicas, ingress)
