"""LoRA-affinity router vs Serve's default multiplexed routing on the same replicas.

N adapters with Zipf popularity, a fixed request sequence (seeded), C concurrent
clients against a real local cluster (Ray Serve on CPU, real redis-server, the demo
model). For each router: adapter loads (GPU slot loads summed over replicas, from
their routing stats), p50 / p99 latency, throughput. The floor printed beside the
loads is the number of distinct adapters requested (each must be loaded once).

    PYTHONPATH=$PWD python benchmarks/cluster_routing.py \
        --out benchmarks/results/cluster_routing.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import ray
from ray import serve

from cluster.registry import Registry
from deploy.builder import ClusterArgs, bind_app
from deploy.demo import ensure_demo, write_demo_adapter
from deploy.local_redis import free_port, start_redis_server


def make_adapters(root: Path, n: int) -> dict[str, Path]:
    """n rank-8 q/v adapters for the demo model."""
    paths = [
        write_demo_adapter(root / f"bench-{i:03d}", ("q_proj", "v_proj"), 8, 16, 1000 + i)
        for i in range(n)
    ]
    return {p.name: p for p in paths}


def zipf_sequence(names: list[str], n: int, s: float, seed: int) -> list[str]:
    weights = [1.0 / (rank + 1) ** s for rank in range(len(names))]
    return random.Random(seed).choices(names, weights=weights, k=n)


def replica_stats() -> list[dict]:
    out = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith("SERVE_REPLICA") and "LoraReplica" in a["name"]:
            actor = ray.get_actor(a["name"], namespace=a["namespace"])
            out.append(ray.get(actor.record_routing_stats.remote(), timeout=30))
    return out


async def drive(
    url: str, sequence: list[str], concurrency: int, max_tokens: int
) -> tuple[list[float], float]:
    latencies: list[float] = []
    queue = list(reversed(sequence))

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            model = queue.pop()
            body = {
                "model": model,
                "prompt": "hello world how are",
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            t0 = time.perf_counter()
            r = await client.post(f"{url}/v1/completions", json=body)
            r.raise_for_status()
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*[worker(client) for _ in range(concurrency)])
    return latencies, time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_one(router: str, max_loras: int, args, model_dir: str, redis_url: str, http: str) -> dict:
    cfg = ClusterArgs(
        router=router,
        max_loras=max_loras,
        max_cpu_loras=2 * max_loras,
        num_replicas=args.replicas,
        num_cpus_per_replica=0.5,
        routing_stats_period_s=0.5,
        hot_queue_len=args.hot_queue_len,
        device="cpu",
        kv_cache_tokens=8192,
    )
    serve.run(bind_app(cfg, model_dir, redis_url), name="bench", route_prefix="/")
    names = [f"bench-{i:03d}" for i in range(args.adapters)]
    sequence = zipf_sequence(names, args.requests, args.zipf, args.seed)
    asyncio.run(drive(http, ["lorafleet-demo-base"] * 4, 2, args.max_tokens))  # warm up
    loads0 = sum(s["adapter_loads"] for s in replica_stats())
    latencies, wall = asyncio.run(drive(http, sequence, args.concurrency, args.max_tokens))
    time.sleep(1.0)
    loads = sum(s["adapter_loads"] for s in replica_stats()) - loads0
    serve.delete("bench")
    return {
        "router": router,
        "max_loras": max_loras,
        "max_cpu_loras": 2 * max_loras,
        "adapter_loads": loads,
        "distinct_adapters": len(set(sequence)),
        "p50_latency_s": round(pct(latencies, 0.50), 4),
        "p99_latency_s": round(pct(latencies, 0.99), 4),
        "throughput_req_s": round(len(latencies) / wall, 2),
        "throughput_tok_s": round(len(latencies) * args.max_tokens / wall, 1),
        "wall_s": round(wall, 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--adapters", type=int, default=12)
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument(
        "--max-loras", type=int, nargs="+", default=[2, 4], help="one scenario each (CPU cache: 2x)"
    )
    p.add_argument("--hot-queue-len", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="lorafleet-bench-"))
    demo = ensure_demo(tmp / "demo")
    adapters = make_adapters(tmp / "adapters", args.adapters)
    redis_url, redis_proc = start_redis_server(None, tmp / "redis")
    reg = Registry(redis_url)
    for name, path in adapters.items():
        reg.register_adapter(name, str(path), public=True)
    reg.close()
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    results = []
    try:
        for max_loras in args.max_loras:
            for router in ("affinity", "default"):
                res = run_one(
                    router,
                    max_loras,
                    args,
                    str(demo.model_dir),
                    redis_url,
                    f"http://127.0.0.1:{port}",
                )
                _report(res)
                results.append(res)
    finally:
        serve.shutdown()
        ray.shutdown()
        redis_proc.terminate()
        redis_proc.wait(timeout=30)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    doc = {
        "benchmark": "cluster_routing",
        "config": config,
        "device": "cpu (2 cores)",
        "results": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def _report(res: dict) -> None:
    print(
        f"max_loras {res['max_loras']} {res['router']:9s} loads {res['adapter_loads']:4d} "
        f"(floor {res['distinct_adapters']}) "
        f"p50 {res['p50_latency_s']:.3f}s p99 {res['p99_latency_s']:.3f}s "
        f"{res['throughput_req_s']:.2f} req/s",
        flush=True,
    )


if __name__ == "__main__":
    code = main()
    # The results are written. End without exit()'s C++ static destructors: Ray 2.60's
    # metric-exporter thread, left running by ray.shutdown(), can crash the process in
    # them (tests/conftest.py, _exit_before_native_teardown, has the core dump's story).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
