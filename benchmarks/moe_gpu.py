"""One MoE layer's routed experts on the GPU (bf16): the fused Triton kernels
(kernels.fused_moe) against the dense-masked path (every expert on every token) and the
grouped path (one GEMM pair per hit expert, a host sync). --shape picks the layer
(benchmarks/moe_shapes.py): mixtral (Mixtral-8x7B: H 4096, I 14336, 8 experts, top-2,
the default), qwen3-moe (Qwen3-30B-A3B: H 2048, I 768, 128 experts, top-8) or qwen2-moe
(Qwen1.5-MoE-A2.7B: H 2048, I 1408, 60 experts, top-4; its shared expert not included).

    python3 benchmarks/moe_gpu.py [--shape qwen3-moe] [--sweep] [--dry-run] --out R.json

At T in {1, 8, 32, 128, 512} tokens (and 2048 for the Qwen shapes), routed by a random
router (softmax top-k of random logits): fused and dense under CUDA-graph replay (as
decode runs them), fused eager too (all five of its launches: the alignment's two, the
two GEMMs, the sum), grouped eager (it cannot be captured). Dense is skipped past
E x T = 65536 expert rows.
Floor: the weights of the experts the routing touches plus x read and y written once, at
the copy bandwidth measured in the same run; each figure is printed with its ratio to it.
--sweep also times other tile configs of the fused kernels (kernels.triton.fused_moe
.CONFIG_OVERRIDE) per T: gate_up tiles with the default down tile, then down tiles with
the best gate_up, for each block height up to about twice the mean rows per expert; it
prints its size and estimated time first and its progress as it goes. --dry-run prints
the T list and the sweep's plan and exits (no GPU needed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lora_bench import probe_header, time_graph  # noqa: E402
from benchmarks.moe_shapes import (  # noqa: E402
    SHAPES,
    MoeShape,
    block_heights,
    dense_skip,
    down_configs,
    floor_bytes,
    gate_up_configs,
    routing,
    sweep_plan,
)
from kernels import fused_moe  # noqa: E402
from kernels.testing import rel_err  # noqa: E402
from kernels.triton import fused_moe as fm  # noqa: E402
from replica.models.moe import LocalExperts  # noqa: E402

DT = torch.bfloat16
INF = float("inf")


def experts(shape: MoeShape) -> LocalExperts:
    """The layer's experts (E x 3 I H bf16: 2.8 GB for mixtral, 1.2 GB for qwen3-moe),
    fresh random weights, drawn expert by expert."""
    h, i, n = shape.hidden, shape.inter, shape.experts
    with torch.device("meta"):
        layer = LocalExperts(n, h, i)
    w13 = torch.empty(n, 2 * i, h, dtype=DT, device="cuda")
    w2 = torch.empty(n, h, i, dtype=DT, device="cuda")
    for e in range(n):
        w13[e] = torch.randn(2 * i, h, device="cuda") * h**-0.5
        w2[e] = torch.randn(h, i, device="cuda") * i**-0.5
    layer.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)
    layer.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    return layer


@dataclasses.dataclass
class Progress:
    """The sweep's timings done, out of `total`; `start`: the run's time.time() after the
    layer is built; `sweep_s`: seconds spent in sweeps so far."""

    total: int
    start: float
    done: int = 0
    sweep_s: float = 0.0

    def tick(self, cfg: fm.MoeConfig, us: float) -> None:
        self.done += 1
        g, d = cfg.gate_up, cfg.down
        print(f"     [{self.done}/{self.total} {time.time() - self.start:.0f} s] m{cfg.block_m} "
              f"gate_up {g.block_n}x{g.block_k} w{g.num_warps} s{g.num_stages}, down "
              f"{d.block_n}x{d.block_k} w{d.num_warps} s{d.num_stages}: {us:.1f} us", flush=True)  # fmt: skip


def time_fused_configs(call, configs: list[fm.MoeConfig], progress: Progress) -> list[float]:
    """Graph-replay us of call (a fused_moe into a fixed out) under each config
    (CONFIG_OVERRIDE); inf for a tile that does not fit the device (shared memory)."""
    times = []
    for cfg in configs:
        fm.CONFIG_OVERRIDE = cfg
        try:
            times.append(time_graph([call]))
        except OutOfResources as e:
            print(f"     {cfg}: {e}", flush=True)
            times.append(INF)
        finally:
            fm.CONFIG_OVERRIDE = None
        progress.tick(cfg, times[-1])
    return times


def sweep(shape: MoeShape, tokens: int, call, progress: Progress) -> list[dict]:
    """Per block height: gate_up tiles (default down), then down tiles (best gate_up);
    -> every config tried with its graph us (None: did not fit), fastest first."""
    rows, t0 = [], time.time()
    for bm in block_heights(shape, tokens):
        gu = gate_up_configs(shape, tokens, bm)
        t_gu = time_fused_configs(call, gu, progress)
        best = gu[min(range(len(gu)), key=t_gu.__getitem__)].gate_up
        dn = down_configs(shape, bm, best)
        t_dn = time_fused_configs(call, dn, progress)
        rows += [
            {"config": dataclasses.asdict(cfg), "graph_us": us if us < INF else None}
            for cfg, us in zip(gu + dn, t_gu + t_dn, strict=True)
        ]
    progress.sweep_s += time.time() - t0
    return sorted(rows, key=lambda r: INF if r["graph_us"] is None else r["graph_us"])


def measure(shape: MoeShape, layer, tokens: int, bw: float, gen, progress: Progress | None) -> dict:
    """One T's row: floor, each path's us, errors against grouped, the sweep if progress."""
    x = (torch.randn(tokens, shape.hidden, device="cuda", generator=gen)).to(DT)
    w, ids = routing(shape, tokens, gen)
    floor = floor_bytes(shape, tokens, ids)
    w13, w2 = layer.gate_up_proj, layer.down_proj
    call = partial(fused_moe, x, w13, w2, ids, w, out=torch.empty_like(x))
    skip = dense_skip(shape, tokens)
    fused = fused_moe(x, w13, w2, ids, w)
    dense = None if skip else layer.dense(x, ids, w)
    grouped = layer.grouped(x, ids, w)
    row = {
        "tokens": tokens,
        **floor,
        "floor_us": floor["bytes"] / bw * 1e6,
        "config": dataclasses.asdict(fm.moe_config(tokens, shape.top_k, shape.experts)),
        "fused_graph_us": time_graph([call]),
        "fused_eager_us": do_bench(call, return_mode="median") * 1e3,
        "dense_graph_us": None if skip else time_graph([partial(layer.dense, x, ids, w)]),
        "grouped_eager_us": do_bench(lambda: layer.grouped(x, ids, w), return_mode="median") * 1e3,
        "rel_err_fused_vs_grouped": rel_err(fused, grouped),
        "rel_err_dense_vs_grouped": None if skip else rel_err(dense, grouped),
    }
    if skip:
        row["dense_skipped"] = skip
    if progress is not None:
        row["sweep"] = sweep(shape, tokens, call, progress)
        row["sweep_best"] = row["sweep"][0]
    return row


def parse_args() -> argparse.Namespace:
    """The flags, with .shape a MoeShape and .tokens its T list (or --tokens')."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="mixtral", help="the MoE layer")
    ap.add_argument("--tokens", default=None, help="comma-separated T (default: the shape's)")
    ap.add_argument("--sweep", action="store_true", help="also time other fused tile configs")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    args.name, args.shape = args.shape, SHAPES[args.shape]
    if args.tokens is None:
        args.tokens = list(args.shape.tokens)
    else:
        parts = args.tokens.split(",")
        if not all(p.isdigit() and int(p) > 0 for p in parts):
            ap.error(f"--tokens {args.tokens!r}: allowed: comma-separated token counts >= 1")
        args.tokens = [int(p) for p in parts]
    return args


def print_plan(name: str, shape: MoeShape, token_list: list[int], do_sweep: bool) -> dict:
    """Print each T's mean rows per expert, block heights and dense skip, and the sweep's
    size and estimate; -> sweep_plan's dict (timings 0 without --sweep)."""
    print(f"{name}: {shape.model}, H {shape.hidden}, I {shape.inter}, {shape.experts} experts "
          f"top-{shape.top_k}")  # fmt: skip
    for tokens in token_list:
        heights = ", ".join(map(str, block_heights(shape, tokens)))
        skip = dense_skip(shape, tokens)
        print(f"  T {tokens}: {tokens * shape.top_k / shape.experts:.3g} rows an expert; sweep "
              f"block heights {heights}" + (f"; dense skipped: {skip}" if skip else ""))  # fmt: skip
    plan = sweep_plan(shape, token_list if do_sweep else [])
    if do_sweep:
        print(f"sweep: {plan['timings']} timings, ~{plan['compiles']} kernel compiles, "
              f"estimate ~{plan['estimate_s'] / 60:.1f} min", flush=True)  # fmt: skip
    return plan


def main() -> None:
    args = parse_args()
    shape = args.shape
    plan = (
        print_plan(args.name, shape, args.tokens, args.sweep) if args.sweep or args.dry_run else {}
    )
    if args.dry_run:
        return
    bw, header = probe_header()
    layer = experts(shape)
    gen = torch.Generator(device="cuda").manual_seed(0)
    progress = Progress(plan["timings"], time.time()) if args.sweep else None
    print(f"{shape.model} MoE layer, {DT}, {shape.experts} experts top-{shape.top_k}; us (x floor)")
    print(
        f"{'T':>4} {'experts':>7} {'floor':>7} {'fused graph':>16} {'fused eager':>16} "
        f"{'dense graph':>16} {'grouped eager':>16}"
    )
    rows = []
    for tokens in args.tokens:
        r = measure(shape, layer, tokens, bw, gen, progress)
        rows.append(r)
        cells = [
            f"{'skipped':>16}" if r[k] is None else f"{r[k]:>8.1f} ({r[k] / r['floor_us']:>4.2f}x)"
            for k in ("fused_graph_us", "fused_eager_us", "dense_graph_us", "grouped_eager_us")
        ]
        print(
            f"{tokens:>4} {r['experts_touched']:>7} {r['floor_us']:>7.1f} " + " ".join(cells),
            flush=True,
        )
        if args.sweep:
            best = r["sweep_best"]
            print(f"     sweep best {best['graph_us']:.1f} us: {best['config']}", flush=True)
    if args.out:
        dims = {"H": shape.hidden, "I": shape.inter, "E": shape.experts, "k": shape.top_k}
        doc = {**header, "shape": {"name": args.name, "model": shape.model, **dims,
                                   "normalize_topk": shape.normalize, "dtype": str(DT)}}  # fmt: skip
        if args.sweep:
            doc["sweep_plan"] = {
                **plan,
                "sweep_s": progress.sweep_s,
                "run_s": time.time() - progress.start,
            }
        args.out.write_text(json.dumps({**doc, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
