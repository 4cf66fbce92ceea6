"""Registry benchmark: request-path lookup and heartbeat against a real Redis.

Populates 10k adapters, 100 tenants with keys and grants, 64 replicas with
residency (each holds 32 adapters in GPU and 96 in CPU, plus one "hot" adapter
resident on all 64), then measures single-client latency (p50/p99) and ops/s of

  - resolve_request (key -> tenant, adapter -> ref, authorize, live locations),
    random adapters, half by the owner and half by a granted tenant
  - resolve_request of the hot adapter (64 live locations to check)
  - heartbeat (owner-checked lease renewal)

each beside its floors measured in the same run: a bare PING round trip and an
EVALSHA of a script that returns at once. Also a multi-threaded ops/s figure of
resolve_request. Writes benchmarks/results/registry.json.

    python benchmarks/registry.py                   # starts a private redis-server
    python benchmarks/registry.py --redis-url URL   # uses URL (namespace "bench", flushed)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cluster.keys import Keys  # noqa: E402
from cluster.registry import Registry  # noqa: E402

NS = "bench"


def populate(reg: Registry, adapters: int, replicas: int, tenants: int, seed: int) -> dict:
    """Fill the namespace; returns what the measurements need (names, keys, epochs)."""
    rng = random.Random(seed)
    keys, client = Keys(NS), reg.client
    names = [f"adapter-{i:05d}" for i in range(adapters)] + ["hot"]
    tenant_names = [f"tenant-{i:03d}" for i in range(tenants)]
    api_keys = {}
    for t in tenant_names:
        reg.create_tenant(t)
        api_keys[t] = reg.issue_api_key(t)
    pipe = client.pipeline(transaction=False)
    owners, grantees = {}, {}
    for i, name in enumerate(names):
        owners[name] = tenant_names[i % tenants]
        grantees[name] = tenant_names[(i + 1) % tenants]
        # the same fields the register_adapter script writes (validation is not measured)
        pipe.hset(keys.adapter(name), mapping={
            "name": name, "version": 1, "content_hash": f"{i:064x}", "path": f"/a/{name}",
            "rank": 16, "base_model": "bench-base", "target_modules": '["q_proj","v_proj"]',
            "owner": owners[name], "public": int(name == "hot"), "created": time.time(),
            "state": "active",
        })  # fmt: skip
        pipe.set(keys.version(name), 1)
        pipe.sadd(keys.adapters, name)
        pipe.sadd(keys.grants(name), grantees[name])
    pipe.execute()
    epochs = {}
    for r in range(replicas):
        rid = f"replica-{r:02d}"
        pool = ("prefill", "decode", "mixed")[r % 3]
        epochs[rid] = reg.register_replica(rid, pool, "bench", 32, 600.0)
        held = rng.sample(names[:-1], 128)
        for j, name in enumerate(held):
            reg.report_resident(rid, epochs[rid], (name, 1), "gpu" if j < 32 else "cpu")
        reg.report_resident(rid, epochs[rid], ("hot", 1), "gpu")
    return {"names": names[:-1], "owners": owners, "grantees": grantees, "api_keys": api_keys,
            "epochs": epochs}  # fmt: skip


def timed(fn: Callable[[int], object], n: int) -> tuple[list[float], float]:
    """Run fn(i) n times sequentially: (per-call seconds, wall seconds)."""
    lat = []
    start = time.perf_counter()
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        lat.append(time.perf_counter() - t0)
    return lat, time.perf_counter() - start


def measure_interleaved(ops: dict[str, Callable[[int], object]], n: int, rounds: int) -> dict:
    """Measure every op in `rounds` interleaved rounds of n // rounds calls (so a noisy
    neighbour hurts all figures alike); latency percentiles in microseconds."""
    lats: dict[str, list[float]] = {k: [] for k in ops}
    walls = dict.fromkeys(ops, 0.0)
    for fn in ops.values():
        timed(fn, min(200, n))  # warm-up: connections, script cache
    for _ in range(rounds):
        for name, fn in ops.items():
            lat, wall = timed(fn, n // rounds)
            lats[name] += lat
            walls[name] += wall
    out = {}
    for name, lat in lats.items():
        lat.sort()
        m = len(lat)
        out[name] = {
            "ops": m,
            "ops_per_s": round(m / walls[name]),
            "p50_us": round(lat[m // 2] * 1e6, 1),
            "p99_us": round(lat[int(m * 0.99)] * 1e6, 1),
        }
    return out


def server_time_us(reg: Registry, fn: Callable[[int], object], n: int) -> float:
    """Redis-side microseconds per EVALSHA of fn (from INFO commandstats)."""
    reg.client.config_resetstat()
    for i in range(n):
        fn(i)
    return float(reg.client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])


def measure_threads(fn: Callable[[int], object], n: int, threads: int) -> dict:
    per = n // threads

    def worker(t: int) -> None:
        for i in range(per):
            fn(t * per + i)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(worker, range(threads)))
    return {"ops": per * threads, "threads": threads,
            "ops_per_s": round(per * threads / (time.perf_counter() - start))}  # fmt: skip


def run(url: str, args: argparse.Namespace) -> dict:
    reg = Registry(url, NS, max_lora_rank=64)
    for key in reg.client.scan_iter(f"{NS}:*", count=1000):
        reg.client.delete(key)
    t0 = time.perf_counter()
    data = populate(reg, args.adapters, args.replicas, args.tenants, args.seed)
    populate_s = time.perf_counter() - t0
    names, owners, api_keys, epochs = (data[k] for k in ("names", "owners", "api_keys", "epochs"))
    rng = random.Random(args.seed)
    picks = [rng.choice(names) for _ in range(args.ops)]
    # half the lookups by the owner, half by a granted tenant (the SISMEMBER path)
    grantees = data["grantees"]
    pick_keys = [api_keys[(owners if i % 2 else grantees)[n]] for i, n in enumerate(picks)]
    rids = list(epochs)
    noop = reg.client.register_script("return 1")
    hot_key = api_keys[owners["hot"]]
    assert len(reg.resolve_request(hot_key, "hot").locations) == args.replicas

    hb = [(rids[i % len(rids)], epochs[rids[i % len(rids)]]) for i in range(args.ops)]
    ops = {
        "ping_floor": lambda i: reg.client.ping(),
        "evalsha_noop_floor": lambda i: noop(),
        "resolve_request": lambda i: reg.resolve_request(pick_keys[i], picks[i]),
        "resolve_request_hot_64_locations": lambda i: reg.resolve_request(hot_key, "hot"),
        "heartbeat": lambda i: reg.heartbeat(hb[i][0], hb[i][1], 600.0),
    }
    figures = measure_interleaved(ops, args.ops, rounds=5)
    for name in (
        "evalsha_noop_floor",
        "resolve_request",
        "resolve_request_hot_64_locations",
        "heartbeat",
    ):
        figures[name]["server_us"] = server_time_us(reg, ops[name], 2000)
    figures["resolve_request_threads"] = measure_threads(
        lambda i: reg.resolve_request(pick_keys[i], picks[i]), args.ops, args.threads
    )
    info = reg.client.info("server")
    reg.close()
    return {
        "populate_s": round(populate_s, 2),
        "figures": figures,
        "redis_version": info["redis_version"],
    }


def report(result: dict) -> None:
    f = result["figures"]
    ping, noop = f["ping_floor"], f["evalsha_noop_floor"]
    print(f"{'operation':34s} {'ops/s':>7s} {'p50 us':>7s} {'p99 us':>7s} {'redis us':>8s}"
          "  p50/PING  p50/EVALSHA-noop")  # fmt: skip
    for name, m in f.items():
        if "p50_us" not in m:
            continue
        server = f"{m['server_us']:8.1f}" if "server_us" in m else f"{'-':>8s}"
        print(f"{name:34s} {m['ops_per_s']:7d} {m['p50_us']:7.1f} {m['p99_us']:7.1f} {server}"
              f"  {m['p50_us'] / ping['p50_us']:7.2f}x  {m['p50_us'] / noop['p50_us']:7.2f}x")  # fmt: skip
    t = f["resolve_request_threads"]
    print(f"resolve_request with {t['threads']} threads: {t['ops_per_s']} ops/s "
          f"(single-client PING floor {ping['ops_per_s']} ops/s)")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", default=None, help="Redis to use (default: start one)")
    p.add_argument("--adapters", type=int, default=10_000)
    p.add_argument("--replicas", type=int, default=64)
    p.add_argument("--tenants", type=int, default=100)
    p.add_argument("--ops", type=int, default=20_000, help="operations per measurement")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "registry.json"))
    args = p.parse_args()
    stop = None
    url = args.redis_url
    if url is None:
        from tests.redis_fixture import start_redis

        url, stop = start_redis(tempfile.mkdtemp(prefix="lorafleet-bench-redis-"))
    try:
        result = run(url, args)
    finally:
        if stop is not None:
            stop()
    report(result)
    result.update({
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "redis": "private redis-server on 127.0.0.1 (started by the benchmark)"
        if args.redis_url is None else "given --redis-url",
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "loadavg_1m_at_end": round(os.getloadavg()[0], 2)},
        "when_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    })  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
