"""Would CUTLASS's grouped GEMM beat the library's decode shrink? (GPU probe.)

The notes on the kernel misses (results/lora_kernels_h200.json, notes_on_misses) name a
CUTLASS kernel as one way to close them. torch ships one: `torch._grouped_mm` (2D x 3D
with group offsets, the MoE grouped GEMM: on Hopper a CUTLASS kernel with TMA loads and
warp-specialised pipelines). A segmented shrink is that GEMM with the adapters as
groups: s[rows of slot g] = x[rows of slot g] @ A_g^T, every slice's A stacked into one
[S*R, H] operand per slot. This probe times it against kernels.lora_shrink on the decode
shapes whose shrink dominates a miss (and a few that meet the target), per shape (bf16,
Llama-3-8B layers, n adapters in a 64-slot pool, CUDA-graph replay, inputs rotated past
L2):

  lorafleet     kernels.lora_shrink into the step's zeroed workspace (fp32 [S, T, R]),
                rows gathered by the kernel, as the engine runs it
  gmm_sorted    torch._grouped_mm with x's rows already grouped by slot (what it would
                cost if the engine ordered a step's rows by adapter), bf16 out [T, S*R]
  gmm_gather    the same after x[order] (rows in batch order, as the kernels take them)

beside the shrink's byte floor (x + A + the fp32 output at the copy bandwidth measured in
the same run). Only the shrink is probed: the expand adds into y, which a grouped GEMM
(out of place) cannot do without another pass over y.

    python3 benchmarks/grouped_mm_probe.py --out benchmarks/results/grouped_mm_probe_h200.json

A probe, not a kernel of the library (benchmarks/README.md, "Probes").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lora_bench import (  # noqa: E402
    LAYERS,
    POOL_SLOTS,
    Pools,
    call_shrink,
    floor_bytes,
    make_sets,
    num_sets,
    probe_header,
    time_graph,
    workspaces,
)

# (layer, rank, T, n): the decode misses of results/lora_kernels_h200.json whose shrink is
# most of the time, then shapes that meet the 12 us target, for scale
SHAPES = [
    ("qkv", 16, 256, 32),
    ("qkv", 16, 64, 64),
    ("qkv", 16, 256, 64),
    ("qkv", 64, 256, 8),
    ("o", 16, 64, 64),
    ("o", 16, 256, 64),
    ("o", 64, 256, 32),
    ("down", 16, 64, 64),
    ("down", 16, 256, 32),
    ("down", 16, 256, 64),
    ("down", 64, 256, 8),
    ("gate_up", 16, 64, 32),
    ("qkv", 16, 64, 8),
    ("o", 16, 64, 8),
    ("qkv", 16, 1, 1),
]


def grouped_inputs(st: dict) -> None:
    """Add to set st what torch._grouped_mm needs: the stacked A of every slot as
    [L, H, S*R] (a transposed view of [L, S*R, H], which the op takes), the row order
    grouping x by slot, x in that order, and int32 group end offsets over all L slots."""
    a = torch.cat(st["pool"].a, dim=1)  # [L, S*R, H]
    st["a_t"] = a.transpose(1, 2)
    slots = st["slots"]
    order = torch.argsort(slots, stable=True)
    st["order"] = order
    st["x_sorted"] = st["x"][order].contiguous()
    counts = torch.bincount(slots.clamp_min(0), minlength=POOL_SLOTS)
    st["offs"] = torch.cumsum(counts, 0).to(torch.int32)


def gmm(st: dict, gather: bool) -> torch.Tensor:
    x = st["x"][st["order"]] if gather else st["x_sorted"]
    return torch._grouped_mm(x, st["a_t"], offs=st["offs"])


def check(st: dict, view: torch.Tensor) -> float:
    """Max |gmm - lorafleet| / max |lorafleet| on set st (both from the same inputs)."""
    view.zero_()
    call_shrink(st, out=view)
    want = view.permute(1, 0, 2).reshape(view.shape[1], -1)  # [T, S*R] in batch order
    got = torch.empty_like(want)
    got[st["order"]] = gmm(st, gather=False).float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def run_shape(layer: str, rank: int, tokens: int, n: int, bw: float) -> dict:
    floor = floor_bytes(layer, tokens, n, rank, rank)
    nsets = num_sets(floor)
    sets, _ = make_sets(
        layer, Pools(layer, rank), tokens, n, nsets, lambda i: rank, expected_slots=n
    )
    for st in sets:
        grouped_inputs(st)
    memset, views = workspaces(sets, layer, rank)
    pairs = list(zip(sets, views, strict=True))
    row = {"layer": layer, "rank": rank, "T": tokens, "n": n, "sets": nsets}
    row["shrink_floor_us"] = floor["shrink"] / bw * 1e6
    row["lorafleet_us"] = time_graph(
        [lambda p=p: call_shrink(p[0], out=p[1]) for p in pairs], prologue=memset
    )
    try:
        row["gmm_sorted_us"] = time_graph([lambda st=st: gmm(st, False) for st in sets])
        row["gmm_gather_us"] = time_graph([lambda st=st: gmm(st, True) for st in sets])
        row["gmm_rel_err"] = check(*pairs[0])
    except Exception as e:  # an op this torch cannot run is data too
        row["gmm_error"] = repr(e)[:300]
    del sets, pairs, views
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--budget-s", type=float, default=240)
    args = ap.parse_args()
    torch.manual_seed(0)
    bw, doc = probe_header()
    doc["rows"] = []
    t0 = time.monotonic()
    print("shape                  | floor | lorafleet | gmm sorted | gmm gather | err", flush=True)
    for layer, rank, tokens, n in SHAPES:
        if time.monotonic() - t0 > args.budget_s:
            print(f"budget spent: skipping {layer} r{rank} T={tokens} n={n}", flush=True)
            continue
        assert layer in LAYERS
        r = run_shape(layer, rank, tokens, n, bw)
        doc["rows"].append(r)
        name = f"{layer} r{rank} T={tokens} n={n}"
        if "gmm_error" in r:
            print(f"{name:22s} | {r['shrink_floor_us']:5.2f} | {r['lorafleet_us']:9.2f} | "
                  f"{r['gmm_error']}", flush=True)  # fmt: skip
        else:
            print(f"{name:22s} | {r['shrink_floor_us']:5.2f} | {r['lorafleet_us']:9.2f} | "
                  f"{r['gmm_sorted_us']:10.2f} | {r['gmm_gather_us']:10.2f} | "
                  f"{r['gmm_rel_err']:.1e}", flush=True)  # fmt: skip
        if args.out:
            args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
