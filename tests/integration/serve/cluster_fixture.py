"""One real lorafleet cluster for a test module: Ray + Serve on CPU, a real redis-server.

8 adapters (the 3 demo ones + 5 generated) on 2 replicas with max_loras 2, auth on.
Tenants: "ops" (owns everything private, key OPS), "t1" (owns t1-private; key T1),
"t2" (granted extra-0; key T2). Public: demo-*, extra-1..4.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ray
from ray import serve

from cluster.registry import Registry
from deploy.builder import ClusterArgs, bind_app
from deploy.demo import DemoAssets, ensure_demo, write_demo_adapter
from deploy.local_redis import free_port
from tests.polling import wait_for
from tests.redis_fixture import start_redis

APP = "lorafleet"
ADMIN_KEY = "admin-secret"


def make_extra_adapters(root: Path, n: int = 5) -> dict[str, Path]:
    """n rank-8 q/v adapters for the demo model: extra-0 .. extra-{n-1}."""
    return {
        f"extra-{i}": write_demo_adapter(root / f"extra-{i}", ("q_proj", "v_proj"), 8, 16, 100 + i)
        for i in range(n)
    }


@dataclass
class Cluster:
    http: str
    grpc: str
    redis_url: str
    demo: DemoAssets
    adapters: dict[str, Path]
    keys: dict[str, str]
    base: str
    stop_redis: object = None
    metrics: str = ""
    app: str = APP
    """The Serve application the gRPC calls name (`start_app_beside`)."""
    namespace: str = "lorafleet"
    """The app's registry namespace."""

    def registry(self) -> Registry:
        return Registry(self.redis_url, self.namespace)

    def grpc_stub(self):
        """An Inference stub on a new channel to the cluster's gRPC proxy."""
        import grpc

        from router.proto import lorafleet_pb2_grpc as pb_grpc

        return pb_grpc.InferenceStub(grpc.insecure_channel(self.grpc))

    def grpc_auth(self, key: str = "ops") -> tuple[tuple[str, str], ...]:
        """gRPC metadata carrying the API key of `key` (a name in `keys`) and the app."""
        return (("authorization", f"Bearer {self.keys[key]}"), ("application", self.app))

    def replica_actors(self) -> dict[str, ray.actor.ActorHandle]:
        """Serve replica id -> actor handle of each live LoraReplica."""
        out = {}
        for a in ray.util.list_named_actors(all_namespaces=True):
            name = a["name"]
            if "LoraReplica" in name and name.startswith("SERVE_REPLICA"):
                out[name.rsplit("#", 1)[-1]] = ray.get_actor(name, namespace=a["namespace"])
        return out

    def gauge(self, name: str) -> dict[str, float]:
        """Serve replica id -> value of gauge ray_lorafleet_<name> (Prometheus scrape)."""
        import httpx

        out = {}
        for line in httpx.get(self.metrics, timeout=10).text.splitlines():
            if line.startswith(f"ray_lorafleet_{name}{{"):
                tags, value = line.rsplit(" ", 1)
                replica = tags.split('replica="', 1)[1].split('"', 1)[0]
                out[replica] = float(value)
        return out

    def counter(self, name: str, **tags: str) -> float:
        """Sum over replicas of counter ray_lorafleet_<name> with these tags (0 if none)."""
        import httpx

        total = 0.0
        for line in httpx.get(self.metrics, timeout=10).text.splitlines():
            if line.startswith(f"ray_lorafleet_{name}{{") and all(
                f'{k}="{v}"' in line for k, v in tags.items()
            ):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def routing_stats(self) -> dict[str, dict]:
        """Serve replica id -> the dict its record_routing_stats returns."""
        out = {}
        for rid, actor in self.replica_actors().items():
            try:
                out[rid] = ray.get(actor.record_routing_stats.remote(), timeout=10)
            except Exception:
                continue
        return out


def register_tenants(reg: Registry, adapters: dict[str, Path]) -> dict[str, str]:
    for t in ("ops", "t1", "t2"):
        reg.create_tenant(t)
    keys = {t: reg.issue_api_key(t) for t in ("ops", "t1", "t2")}
    for name, path in sorted(adapters.items()):
        private = name in ("extra-0", "t1-private")
        owner = "t1" if name == "t1-private" else "ops"
        reg.register_adapter(name, str(path), tenant=owner, public=not private)
    reg.grant("t2", "extra-0")
    reg.grant("ops", "t1-private")
    return keys


def start_cluster(tmp: Path, **overrides) -> Cluster:
    redis_url, stop_redis = start_redis(tmp / "redis")
    try:
        return _start_on(tmp, redis_url, stop_redis, **overrides)
    except BaseException:  # the fixture never gets a Cluster to stop: stop its Redis here
        stop_redis()
        raise


def cluster_args(**overrides) -> ClusterArgs:
    """The test cluster's args (2 CPU replicas, auth on, short ticks), with overrides."""
    args = dict(
        auth=True,
        admin_key=ADMIN_KEY,
        max_loras=2,
        max_cpu_loras=4,
        num_replicas=2,
        num_cpus_per_replica=0.5,
        routing_stats_period_s=0.5,
        registry_tick_s=0.5,
        lease_ttl_s=2.0,
        kv_cache_tokens=4096,
        device="cpu",
    )
    args.update(overrides)
    if "autoscaling" in overrides:
        del args["num_replicas"]
    return ClusterArgs(**args)


def _start_on(tmp: Path, redis_url: str, stop_redis: Callable[[], None], **overrides) -> Cluster:
    demo = ensure_demo(tmp / "demo")
    adapters = dict(demo.adapters) | make_extra_adapters(tmp / "extra")
    adapters["t1-private"] = adapters.pop("extra-4")
    reg = Registry(redis_url)
    keys = register_tenants(reg, adapters)
    reg.close()
    metrics_port = free_port()
    os.environ.setdefault("RAY_metrics_report_interval_ms", "500")
    if ray.is_initialized():  # a previous module's Ray: this module needs its own options
        ray.shutdown()
    ray.init(
        num_cpus=4, include_dashboard=False, log_to_driver=False, _metrics_export_port=metrics_port
    )
    http_port, grpc_port = start_serve()
    cfg = cluster_args(**overrides)
    serve.run(bind_app(cfg, str(demo.model_dir), redis_url), name=APP, route_prefix="/")
    cluster = Cluster(
        http=f"http://127.0.0.1:{http_port}",
        grpc=f"127.0.0.1:{grpc_port}",
        redis_url=redis_url,
        demo=demo,
        adapters=adapters,
        keys=keys,
        base=demo.model_dir.name,
        stop_redis=stop_redis,
        metrics=f"http://127.0.0.1:{metrics_port}/metrics",
    )
    wait_registered(cluster, cfg.autoscaling.min_replicas if cfg.autoscaling else cfg.num_replicas)
    return cluster


def start_app_beside(cluster: Cluster, app: str, **overrides) -> Cluster:
    """A second app on `cluster`'s Serve, for tests of cluster args the first app lacks:
    at route prefix /<app>, its replicas in registry namespace <app> (the first app's
    routers never see them), auth off (every key passes; model: the base), the test
    cluster's args with overrides. While two apps run, Serve's gRPC proxy takes only
    calls that name theirs (`Cluster.grpc_auth`): stop it with `stop_app_beside` before
    calls to the first app that name none."""
    cfg = cluster_args(auth=False, admin_key="", namespace=app, **overrides)
    beside = dataclasses.replace(
        cluster, http=f"{cluster.http}/{app}", keys={"ops": "unused"}, app=app, namespace=app
    )
    try:
        serve.run(bind_app(cfg, str(cluster.demo.model_dir), cluster.redis_url), name=app,
                  route_prefix=f"/{app}")  # fmt: skip
        wait_registered(beside, cfg.num_replicas)
    except BaseException:  # the fixture never gets the app to stop: stop it here
        stop_app_beside(cluster, app)
        raise
    return beside


def stop_app_beside(cluster: Cluster, app: str, timeout_s: float = 30.0) -> None:
    """Deletes `start_app_beside`'s app and waits until the gRPC proxy lists only the
    first one (it learns of the deletion a moment later)."""
    import grpc
    from ray.serve.generated import serve_pb2, serve_pb2_grpc

    serve.delete(app)
    listing = serve_pb2_grpc.RayServeAPIServiceStub(grpc.insecure_channel(cluster.grpc))

    def only_first() -> bool:
        apps = listing.ListApplications(serve_pb2.ListApplicationsRequest(), timeout=10)
        return list(apps.application_names) == [cluster.app]

    wait_for(
        only_first, timeout_s, f"Serve's gRPC proxy dropping the deleted {app}", interval_s=0.1
    )


def start_serve(attempts: int = 3) -> tuple[int, int]:
    """serve.start on free (http, grpc) ports, picked once Ray runs. A port picked free can
    still be taken before the proxy binds it (Ray's own processes bind ephemeral ports:
    CI once saw "Failed to bind to address [::]:41375"), so a bind failure picks again."""
    for attempt in range(attempts):
        http_port, grpc_port = free_port(), free_port()
        try:
            serve.start(
                http_options={"host": "127.0.0.1", "port": http_port},
                grpc_options={
                    "port": grpc_port,
                    "grpc_servicer_functions": ["router.grpc_proxy.add_inference_servicer"],
                },
            )
            return http_port, grpc_port
        except Exception as e:
            text = str(e).lower()
            taken = "failed to bind" in text or "address already in use" in text
            if not taken or attempt == attempts - 1:
                raise
            serve.shutdown()
    raise AssertionError("unreachable")


def wait_registered(cluster: Cluster, n: int, timeout_s: float = 30.0) -> None:
    reg = cluster.registry()
    try:
        wait_for(
            lambda: sum(1 for r in reg.list_replicas() if r.live) >= n,
            timeout_s,
            f"{n} live replicas in the registry",
            interval_s=0.2,
        )
    finally:
        reg.close()


def stop_cluster(cluster: Cluster) -> None:
    serve.shutdown()
    ray.shutdown()
    cluster.stop_redis()


def offline_greedy_texts(cluster: Cluster, prompt: str, max_tokens: int) -> dict[str, str]:
    """model name -> greedy text of prompt from an in-process offline LLMEngine on the
    cluster's model and adapter directories (the reference for the cluster's answers)."""
    from replica.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return offline_texts(cluster, prompt, params, [cluster.base, *sorted(cluster.adapters)])


def offline_texts(cluster: Cluster, prompt: str, params, names: list[str]) -> dict[str, str]:
    """`offline_greedy_texts` with any SamplingParams, for the models in names."""
    return {
        name: text for name, (text, _) in offline_outputs(cluster, prompt, params, names).items()
    }


def offline_outputs(
    cluster: Cluster, prompt: str, params, names: list[str]
) -> dict[str, tuple[str, list[int]]]:
    """(text, token ids) an offline engine generates for each model in names."""
    from replica.config import EngineConfig
    from replica.engine import LLMEngine
    from replica.offline import adapter_ref

    engine = LLMEngine(
        EngineConfig(model=str(cluster.demo.model_dir), device="cpu", max_loras=8, max_cpu_loras=8)
    )
    ids = engine.tokenizer(prompt).input_ids
    for name in names:
        ref = None if name == cluster.base else adapter_ref(name, cluster.adapters[name], 64)
        engine.add_request(name, ids, params, ref)
    got: dict[str, tuple[str, list[int]]] = {name: ("", []) for name in names}
    while engine.has_unfinished():
        for out in engine.step():
            text, ids = got[out.request_id]
            got[out.request_id] = (text + out.new_text, ids + out.new_token_ids)
    return got


def misfit_adapters(cluster: Cluster, root: Path) -> dict[str, str]:
    """Adapters the demo base cannot take: twice its width ("wide"); NaN weights ("nan")."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from deploy.demo import write_peft_adapter

    cfg = json.loads((cluster.demo.model_dir / "config.json").read_text())
    h, layers = 2 * cfg["hidden_size"], cfg["num_hidden_layers"]
    write_peft_adapter(root / "wide", num_layers=layers, shapes={"q_proj": (h, h)}, rank=4,
                       alpha=8, seed=0, base_model="x")  # fmt: skip
    nan = cluster.adapters["extra-1"]
    weights = load_file(str(nan / "adapter_model.safetensors"))
    weights = {k: torch.full_like(v, float("nan")) for k, v in weights.items()}
    (root / "nan").mkdir()
    save_file(weights, str(root / "nan" / "adapter_model.safetensors"))
    (root / "nan" / "adapter_config.json").write_bytes((nan / "adapter_config.json").read_bytes())
    return {"wide": str(root / "wide"), "nan": str(root / "nan")}


def assert_offsets_match(text: str, tokens: list[str], offsets: list[int]) -> None:
    assert offsets == sorted(offsets) and len(offsets) == len(tokens)
    for tok, off in zip(tokens, offsets, strict=True):
        if "\ufffd" not in tok and not tok.startswith("bytes:"):
            assert text[off:].startswith(tok), (tok, off, text)


def total_loads(cluster) -> int:
    return sum(s["adapter_loads"] for s in cluster.routing_stats().values())


def gpu_holders(cluster, name: str) -> set[str]:
    reg = cluster.registry()
    try:
        return {loc.replica for loc in reg.locations(name) if loc.tier == "gpu"}
    finally:
        reg.close()
