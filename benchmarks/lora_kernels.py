"""Segmented LoRA kernels on the GPU: Llama-3-8B layers against the byte floor and gather+bmm.

    python3 benchmarks/lora_kernels.py --out benchmarks/results/lora_kernels_h200.json

For each layer (qkv, o, gate_up, down), rank, T tokens and n distinct adapters (bf16):
median microseconds of `both` (`lora_shrink_expand`, what the engine's LoRA layers run:
by default the shrink and expand kernels back to back), of the separate `shrink` and
`expand` kernels, and of `fused` (the one-launch persistent kernel, opt-in), eagerly (triton do_bench, L2 flushed between calls) and under CUDA-graph
replay (one graph replays `sets` calls on rotated inputs and weights, so L2 holds none
of the next call's bytes). Metadata is built once per step (as the engine does) and
timed separately. The floor of `both` is the bytes that must move (x, the active
adapters' A and B rows up to their ranks, y read + written) over the copy bandwidth
measured in the same run; shrink's and expand's floors add the fp32 buffer they pass
through memory.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lora_bench import (  # noqa: E402
    EL,
    LAYERS,
    POOL_SLOTS,
    ROTATE_BYTES,
    Pools,
    call_both,
    call_expand,
    call_fused,
    call_shrink,
    copy_bandwidth,
    expecting,
    floor_bytes,
    make_sets,
    num_sets,
    pdl,
    time_both_modes,
    time_graph,
    workspaces,
)
from benchmarks.lora_tune import parse_shapes, sweep, tune, tune_block_m  # noqa: E402
from kernels import SegmentMeta, build_meta, lora_shrink_expand  # noqa: E402
from kernels.reference import lora_expand_ref, lora_shrink_ref  # noqa: E402
from kernels.testing import random_slots, rel_err  # noqa: E402
from kernels.triton.common import pdl_enabled  # noqa: E402

RANKS = (16, 64)
TOKENS = (1, 16, 64, 256, 1024, 4096)
DISTINCT = (1, 8, 32, 64)
EXTRA = [("qkv", 16, 2048, 8), ("qkv", 64, 2048, 32), ("o", 16, 2048, 32)]
REFERENCE_US = {  # vLLM 0.17 Triton shrink+expand, same H200, graph replay (issue 3)
    ("qkv", 16, 64, 8): 46, ("qkv", 16, 256, 32): 90, ("qkv", 16, 2048, 8): 223,
    ("qkv", 64, 2048, 32): 374, ("o", 16, 64, 8): 16, ("o", 16, 2048, 32): 64,
}  # fmt: skip
BASELINE_MAX_BYTES = 3e9


def baseline(x, a, b, y, slots):
    """torch gather+bmm: per-token copies of A and B, then batched GEMVs, slice by slice."""
    off = 0
    for a_s, b_s in zip(a, b, strict=True):
        h = torch.bmm(a_s[slots], x[:, :, None])
        n = b_s.shape[1]
        y[:, off : off + n] += torch.bmm(b_s[slots], h)[:, :, 0]
        off += n


def check(st, ranks, fused: bool) -> float:
    """rel err of one shrink+expand (and of the fused kernel, if timed) against the float64
    reference (on the used slots only)."""
    pool = st["pool"]
    used, local = torch.unique(st["slots"], return_inverse=True)
    a64 = tuple(t[used].double() for t in pool.a)
    b64 = tuple(t[used].double() for t in pool.b)
    buf = lora_shrink_ref(st["x"].double(), a64, local, slot_ranks=ranks[used])
    want = lora_expand_ref(st["y"].double(), buf.double(), b64, local, slot_ranks=ranks[used])
    y = st["y"].clone()
    lora_shrink_expand(y, st["x"], pool.a, pool.b, st["meta"])
    if not fused:
        return rel_err(y, want)
    y_fused = st["y"].clone()
    call_fused({**st, "y": y_fused})
    return max(rel_err(y, want), rel_err(y_fused, want))


def run_case(layer, pools, rank, tokens, n, bw, mixed=False, fused=True, hint=True) -> dict:
    """hint: the step's SegmentMeta expects its n distinct slots (expected_slots = n, as
    the engine sets it from the batch it formed), and `both_full_grid` times the same
    with the tile grids sized for all 64 slots; else every call sizes them for 64."""
    mean_rank = (16 + rank) / 2 if mixed else rank
    fb = floor_bytes(layer, tokens, n, mean_rank, rank)
    nsets = num_sets(fb)
    ranks_of = (lambda i: 16 if i % 2 == 0 else rank) if mixed else (lambda i: rank)
    sets, ranks = make_sets(
        layer, pools, tokens, n, nsets, ranks_of, expected_slots=n if hint else None
    )
    res = {"layer": layer, "rank": rank, "mixed_16_64": mixed, "T": tokens, "n": n, "sets": nsets}
    res["expected_slots"] = n if hint else None
    res["rel_err"] = check(sets[0], ranks, fused)
    res["floor_us"] = {k: fb[k] / bw * 1e6 for k in ("shrink", "expand", "both")}
    res["floor_terms_MB"] = {k: v / 1e6 for k, v in fb["terms"].items()}
    # `both` under graph replay as the engine runs it: shrink outputs in the step's
    # workspace, zeroed by one memset per step (eagerly each call zeroes its own buffer).
    memset, views = workspaces(sets, layer, rank)
    ws_fns = [functools.partial(call_both, st, v) for st, v in zip(sets, views, strict=True)]
    res["both"] = time_both_modes(
        [functools.partial(call_both, st) for st in sets], nsets, ws_fns, memset
    )
    kinds = (("shrink", call_shrink), ("expand", call_expand), ("fused", call_fused))
    for kind, fn in kinds if fused else kinds[:2]:
        res[kind] = time_both_modes([functools.partial(fn, st) for st in sets], nsets)
    if pdl_enabled(torch.device("cuda")):  # `both` without programmatic dependent launch
        with pdl(False):
            res["both_no_pdl"] = {"graph_us": time_graph(ws_fns, prologue=memset)}
    if hint:  # `both` with the tile grids sized for every slot of the pool
        with expecting(sets, None):
            res["both_full_grid"] = {"graph_us": time_graph(ws_fns, prologue=memset)}
    res["ratio_graph_both"] = res["both"]["graph_us"] / res["floor_us"]["both"]
    hidden, sizes = LAYERS[layer]
    gathered = tokens * rank * (len(sizes) * hidden + sum(sizes)) * EL
    if not mixed and gathered <= BASELINE_MAX_BYTES:
        bsets = sets[: max(1, min(nsets, math.ceil(ROTATE_BYTES / gathered)))]
        fns = [
            functools.partial(baseline, st["x"], st["pool"].a, st["pool"].b, st["y"], st["slots"])
            for st in bsets
        ]
        res["gather_bmm"] = time_both_modes(fns, len(bsets))
    del sets
    return res


def meta_build_times() -> dict[str, dict[str, float]]:
    """build_meta into preallocated buffers (once per step, shared by all layers)."""
    out = {}
    for tokens in TOKENS:
        slots = random_slots(tokens, 64, min(32, tokens), 0.1).cuda()
        meta = SegmentMeta.empty(tokens, 64, torch.device("cuda"))
        out[str(tokens)] = time_both_modes([lambda s=slots, m=meta: build_meta(s, 64, out=m)], 1)
    return out


def cases():
    for layer in LAYERS:
        for rank in RANKS:
            grid = [(t, n) for t in TOKENS for n in DISTINCT if n <= t]
            grid += [(t, n) for (lay, r, t, n) in EXTRA if lay == layer and r == rank]
            yield layer, rank, grid


def _key(r):
    return (r["layer"], r["rank"], r["T"], r["n"])


def targets(results: list[dict]) -> list[dict]:
    """Issue 3's kernel targets, judged on CUDA-graph replay (the way decode runs)."""
    ok = [r for r in results if "both" in r]
    main = {_key(r): r for r in ok if not r["mixed_16_64"]}
    out = []

    def add(name, r, value, limit):
        out.append({"target": name, "shape": "{} r{} T={} n={}".format(*_key(r)), "value": round(value, 2),
                    "limit": round(limit, 2), "pass": value <= limit, "by": round(value / limit, 2)})  # fmt: skip

    for r in main.values():
        t = r["both"]["graph_us"]
        if r["floor_us"]["both"] > 20:
            add("floor>20us: both <= 1.5x floor", r, t, 1.5 * r["floor_us"]["both"])
        if r["T"] <= 256:
            add("decode T<=256: both <= 12 us", r, t, 12.0)
        if "gather_bmm" in r and r["T"] >= 64 and r["n"] >= 8:
            add("<= 1/5 of gather+bmm", r, t, r["gather_bmm"]["graph_us"] / 5)
    if ("qkv", 16, 256, 32) in main:
        add(
            "qkv r16 T=256 n=32 <= 10 us",
            main[("qkv", 16, 256, 32)],
            main[("qkv", 16, 256, 32)]["both"]["graph_us"],
            10.0,
        )
    for key, ref in REFERENCE_US.items():
        if key in main:
            add(
                f"<= 1/3 of vLLM reference {ref} us",
                main[key],
                main[key]["both"]["graph_us"],
                ref / 3,
            )
    for r in ok:
        full = main.get(_key(r))
        if r["mixed_16_64"] and full:
            add(
                "mixed 16/64 <= 0.75x all-64",
                r,
                r["both"]["graph_us"],
                0.75 * full["both"]["graph_us"],
            )
    return out


def target_summary(tgts: list[dict]) -> dict[str, dict]:
    """{target: {pass, total, worst_by}} (worst_by: the largest measured / limit)."""
    out: dict[str, dict] = {}
    for t in tgts:
        row = out.setdefault(t["target"], {"pass": 0, "total": 0, "worst_by": 0.0})
        row["pass"] += t["pass"]
        row["total"] += 1
        row["worst_by"] = max(row["worst_by"], t["by"])
    return out


def _fmt(v: float | None, suffix: str = "") -> str:
    return "-" if v is None else f"{v:.1f}{suffix}"


def table(results: list[dict]) -> str:
    head = (
        "| layer | r | T | n | floor us | graph both us | x floor | full-grid graph us | "
        "no-PDL graph us | fused graph us | eager both us | gather+bmm graph us | speedup |"
    )
    lines = [head, "|" + "---|" * 13]
    for r in results:
        if "both" not in r:
            lines.append(
                f"| {r['layer']} | {r['rank']} | {r['T']} | {r['n']} | error: {r.get('error', '')[:60]} |"
            )
            continue
        base = r.get("gather_bmm", {}).get("graph_us")
        rank = "16/64" if r["mixed_16_64"] else r["rank"]
        lines.append(
            f"| {r['layer']} | {rank} | {r['T']} | {r['n']} | {r['floor_us']['both']:.1f} | {r['both']['graph_us']:.1f} | "
            f"{r['ratio_graph_both']:.2f} | {_fmt(r.get('both_full_grid', {}).get('graph_us'))} | "
            f"{_fmt(r.get('both_no_pdl', {}).get('graph_us'))} | "
            f"{_fmt(r.get('fused', {}).get('graph_us'))} | {r['both']['eager_us']:.1f} | "
            f"{_fmt(base)} | {_fmt(None if base is None else base / r['both']['graph_us'], 'x')} |"
        )
    return "\n".join(lines)


def write(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/lora_kernels_h200.json"))
    ap.add_argument("--sweep", action="store_true", help="also time launch-config variants")
    ap.add_argument(
        "--layers", default=",".join(LAYERS), help="comma-separated subset of " + ",".join(LAYERS)
    )
    ap.add_argument(
        "--budget-s", type=float, default=480, help="stop starting new layers after this"
    )
    ap.add_argument("--sweep-budget-s", type=float, default=240, help="time for --sweep")
    ap.add_argument("--no-grid", action="store_true", help="skip the full grid (sweep only)")
    ap.add_argument("--tune", action="store_true", help="time shrink/expand launch configs")
    ap.add_argument("--tune-block-m", action="store_true", help="time tile heights at decode")
    ap.add_argument(
        "--tune-block-m-prefill", action="store_true", help="tile heights and wide-K shrinks, T>256"
    )
    ap.add_argument(
        "--tune-shapes",
        help="shapes for --tune / --tune-block-m[-prefill], layer:rank:T:n,... (default: built-in)",
    )
    ap.add_argument(
        "--tune-block-m-heights", help="tile heights for --tune-block-m[-prefill], e.g. 16,32,64"
    )
    ap.add_argument("--tune-budget-s", type=float, default=240, help="time for --tune")
    ap.add_argument("--tune-kinds", default="both,shrink,expand", help="what --tune times")
    ap.add_argument("--tune-max-tokens", type=int, default=1 << 30, help="--tune shapes' T cap")
    ap.add_argument("--tune-ranks", default="16,64", help="--tune shapes' ranks")
    ap.add_argument("--tune-min-tokens", type=int, default=0, help="--tune shapes' T floor")
    ap.add_argument("--no-fused", action="store_true", help="skip the opt-in fused kernel")
    ap.add_argument(
        "--grid-tokens", help="grid rows of these T only, e.g. 1024,4096 (default: all)"
    )
    ap.add_argument(
        "--no-hint", action="store_true", help="tile grids for all slots (no expected_slots)"
    )
    ap.add_argument("--table", type=Path, help="print the README table of a results file; no GPU")
    args = ap.parse_args()
    if args.table:
        doc = json.loads(args.table.read_text())
        rows = [r for r in doc["results"] if r["T"] == 1 or r["n"] in (8, 32) or r["mixed_16_64"]]
        print(table(rows) + "\n\n| target | pass |\n|---|---|")
        for name, t in target_summary(doc["targets"]).items():
            print(f"| {name} | {t['pass']}/{t['total']} |")
        return
    t0 = time.monotonic()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    doc = {"command": "python3 " + " ".join(sys.argv), "device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
           "triton": triton.__version__, "dtype": "bfloat16", "pool_slots": POOL_SLOTS,
           "copy_bw_TBps": bw / 1e12, "meta_build_us": meta_build_times(), "results": []}  # fmt: skip
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; meta build {doc['meta_build_us']}", flush=True)
    shapes = parse_shapes(args.tune_shapes) if args.tune_shapes else None
    heights = args.tune_block_m_heights
    heights = tuple(int(h) for h in heights.split(",")) if heights else None
    kinds = tuple(args.tune_kinds.split(","))
    if args.tune:
        doc["tune"] = tune(
            bw,
            args.tune_budget_s,
            kinds,
            args.tune_max_tokens,
            args.tune_min_tokens,
            tuple(int(r) for r in args.tune_ranks.split(",")),
            shapes,
        )
        write(args.out, doc)
    if args.tune_block_m:
        doc["tune_block_m"] = tune_block_m(bw, False, shapes, heights, kinds)
        write(args.out, doc)
    if args.tune_block_m_prefill:
        doc["tune_block_m_prefill"] = tune_block_m(bw, True, shapes, heights, kinds)
        write(args.out, doc)
    if args.sweep:
        doc["sweep"] = sweep(bw, args.sweep_budget_s)
        write(args.out, doc)
    for layer, rank, grid in [] if args.no_grid else cases():
        if layer not in args.layers.split(","):
            continue
        if time.monotonic() - t0 > args.budget_s:
            print(f"budget spent: skipping {layer} r{rank}", flush=True)
            continue
        pools = Pools(layer, rank)
        runs = [(t, n, False) for t, n in grid]
        if rank == 64:
            runs += [(t, 32, True) for t in (64, 256, 1024, 4096)]
        if args.grid_tokens:
            keep = {int(t) for t in args.grid_tokens.split(",")}
            runs = [run for run in runs if run[0] in keep]
        for tokens, n, mixed in runs:
            try:
                r = run_case(
                    layer, pools, rank, tokens, n, bw, mixed, not args.no_fused, not args.no_hint
                )
            except Exception as e:  # recorded, and the sweep goes on
                r = {
                    "layer": layer,
                    "rank": rank,
                    "mixed_16_64": mixed,
                    "T": tokens,
                    "n": n,
                    "error": repr(e),
                }
            doc["results"].append(r)
            print(
                table([r]).splitlines()[-1], f"err={r.get('rel_err', float('nan')):.1e}", flush=True
            )
        del pools
        torch.cuda.empty_cache()
        doc["targets"] = targets(doc["results"])
        write(args.out, doc)
        print(f"[{time.monotonic() - t0:.0f}s] {layer} r{rank} done", flush=True)
    doc.setdefault("targets", targets(doc["results"]))
    doc["target_summary"] = target_summary(doc["targets"])
    write(args.out, doc)
    missed = [t for t in doc["targets"] if not t["pass"]]
    print(table(doc["results"]))
    print(f"targets: {len(doc['targets']) - len(missed)}/{len(doc['targets'])} pass")
    for t in missed:
        print(f"  MISS {t['target']}: {t['shape']} {t['value']} us > {t['limit']} us (x{t['by']})")


if __name__ == "__main__":
    main()
