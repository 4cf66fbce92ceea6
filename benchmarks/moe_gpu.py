"""One Mixtral-8x7B MoE layer on the GPU (H 4096, I 14336, 8 experts, top-2, bf16):
the fused Triton kernels (kernels.fused_moe) against the dense-masked path (every expert
on every token) and the grouped path (one GEMM pair per hit expert, a host sync).

    python3 benchmarks/moe_gpu.py --out benchmarks/results/moe_gpu_h100.json [--sweep]

At T in {1, 8, 32, 128, 512} tokens, routed by a random router (softmax top-2 of random
logits): fused and dense under CUDA-graph replay (as decode runs them), fused eager too
(all five of its launches: the alignment's two, the two GEMMs, the sum), grouped eager
(it cannot be captured).
Floor: the weights of the experts the routing touches plus x read and y written once, at
the copy bandwidth measured in the same run; each figure is printed with its ratio to it.
--sweep also times other tile configs of the fused kernels (kernels.triton.fused_moe
.CONFIG_OVERRIDE) per T: gate_up tiles with the default down tile, then down tiles with
the best gate_up, for each block height up to about twice the mean rows per expert.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lora_bench import probe_header, time_graph  # noqa: E402
from kernels import fused_moe  # noqa: E402
from kernels.testing import rel_err  # noqa: E402
from kernels.triton import fused_moe as fm  # noqa: E402
from replica.models.moe import LocalExperts  # noqa: E402

H, INTER, E, TOP_K = 4096, 14336, 8, 2
DT = torch.bfloat16
INF = float("inf")
EXPERT_BYTES = 3 * INTER * H * 2  # gate, up and down rows of one expert, bf16
GATE_UP = [fm.GemmConfig(64, 128, 4, 4), fm.GemmConfig(128, 64, 8, 4), fm.GemmConfig(64, 64, 4, 4)]
DOWN = [fm.GemmConfig(32, 128, 4, 4), fm.GemmConfig(64, 128, 4, 4), fm.GemmConfig(128, 64, 8, 4)]


def experts() -> LocalExperts:
    """The layer's 8 experts (2.8 GB bf16), fresh random weights, drawn expert by expert."""
    with torch.device("meta"):
        layer = LocalExperts(E, H, INTER)
    w13 = torch.empty(E, 2 * INTER, H, dtype=DT, device="cuda")
    w2 = torch.empty(E, H, INTER, dtype=DT, device="cuda")
    for e in range(E):
        w13[e] = torch.randn(2 * INTER, H, device="cuda") * H**-0.5
        w2[e] = torch.randn(H, INTER, device="cuda") * INTER**-0.5
    layer.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)
    layer.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    return layer


def routing(tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, E, device="cuda", generator=gen)
    w, ids = torch.topk(torch.softmax(logits, -1), TOP_K, dim=-1)
    return w / w.sum(-1, keepdim=True), ids


def floor_bytes(tokens: int, ids: torch.Tensor) -> dict[str, float]:
    touched = int(ids.unique().numel())
    return {"experts_touched": touched, "bytes": touched * EXPERT_BYTES + 2 * tokens * H * 2}


def time_fused_configs(layer, x, ids, w, configs) -> list[float]:
    """Graph-replay us of the fused path under each config (CONFIG_OVERRIDE); inf for a
    tile that does not fit the device (shared memory, registers)."""
    out = torch.empty_like(x)
    times = []
    for cfg in configs:
        fm.CONFIG_OVERRIDE = cfg
        try:
            times.append(time_graph([lambda: fused_moe(x, *_weights(layer), ids, w, out=out)]))
        except OutOfResources as e:
            print(f"     {cfg}: {e}", flush=True)
            times.append(INF)
        finally:
            fm.CONFIG_OVERRIDE = None
    return times


def _weights(layer) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.gate_up_proj, layer.down_proj


def sweep(layer, x, ids, w) -> list[dict]:
    """Per block height: gate_up tiles (default down), then down tiles (best gate_up)."""
    per_expert = x.shape[0] * TOP_K / E
    rows = []
    for bm in [m for m in (16, 32, 64, 128) if m == 16 or m <= 2 * per_expert]:
        # 128-row tiles: 3 stages, 8 warps (4 spill gate_up's two accumulators at sm_90)
        fit = {"num_stages": 3, "num_warps": 8} if bm == 128 else {"num_stages": 4}
        base = fm.moe_config(x.shape[0], TOP_K, E).down
        gu = [fm.MoeConfig(bm, dataclasses.replace(g, **fit), base) for g in GATE_UP]
        t_gu = time_fused_configs(layer, x, ids, w, gu)
        best = gu[min(range(len(gu)), key=t_gu.__getitem__)].gate_up
        dn = [fm.MoeConfig(bm, best, dataclasses.replace(d, **fit)) for d in DOWN]
        t_dn = time_fused_configs(layer, x, ids, w, dn)
        rows += [
            {"config": dataclasses.asdict(cfg), "graph_us": us if us < INF else None}
            for cfg, us in zip(gu + dn, t_gu + t_dn, strict=True)
        ]
    return sorted(rows, key=lambda r: INF if r["graph_us"] is None else r["graph_us"])


def measure(layer, tokens: int, bw: float, gen, do_sweep: bool) -> dict:
    x = (torch.randn(tokens, H, device="cuda", generator=gen)).to(DT)
    w, ids = routing(tokens, gen)
    floor = floor_bytes(tokens, ids)
    floor_us = floor["bytes"] / bw * 1e6
    out = torch.empty_like(x)
    fused = fused_moe(x, *_weights(layer), ids, w)
    dense = layer.dense(x, ids, w)
    grouped = layer.grouped(x, ids, w)
    row = {
        "tokens": tokens,
        **floor,
        "floor_us": floor_us,
        "config": dataclasses.asdict(fm.moe_config(tokens, TOP_K, E)),
        "fused_graph_us": time_graph([lambda: fused_moe(x, *_weights(layer), ids, w, out=out)]),
        "fused_eager_us": do_bench(
            lambda: fused_moe(x, *_weights(layer), ids, w, out=out), return_mode="median"
        )
        * 1e3,
        "dense_graph_us": time_graph([lambda: layer.dense(x, ids, w)]),
        "grouped_eager_us": do_bench(lambda: layer.grouped(x, ids, w), return_mode="median") * 1e3,
        "rel_err_fused_vs_grouped": rel_err(fused, grouped),
        "rel_err_dense_vs_grouped": rel_err(dense, grouped),
    }
    if do_sweep:
        row["sweep"] = sweep(layer, x, ids, w)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,8,32,128,512")
    ap.add_argument("--sweep", action="store_true", help="also time other fused tile configs")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    bw, header = probe_header()
    layer = experts()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"Mixtral-8x7B MoE layer, {DT}, {E} experts top-{TOP_K}; us (x floor)")
    print(
        f"{'T':>4} {'experts':>7} {'floor':>7} {'fused graph':>16} {'fused eager':>16} "
        f"{'dense graph':>16} {'grouped eager':>16}"
    )
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        r = measure(layer, tokens, bw, gen, args.sweep)
        rows.append(r)
        cells = [
            f"{r[k]:>8.1f} ({r[k] / r['floor_us']:>4.2f}x)"
            for k in ("fused_graph_us", "fused_eager_us", "dense_graph_us", "grouped_eager_us")
        ]
        print(
            f"{tokens:>4} {r['experts_touched']:>7} {r['floor_us']:>7.1f} " + " ".join(cells),
            flush=True,
        )
        if args.sweep:
            best = r["sweep"][0]
            print(f"     sweep best {best['graph_us']:.1f} us: {best['config']}", flush=True)
    if args.out:
        doc = {**header, "shape": {"H": H, "I": INTER, "E": E, "k": TOP_K, "dtype": str(DT)}}
        args.out.write_text(json.dumps({**doc, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
