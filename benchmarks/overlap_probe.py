"""What does LoRA add to a layer when its shrink runs beside the base GEMM? (GPU probe.)

The shrink only reads x, as the base GEMM does, so it can run on a side stream while
the GEMM runs, the expand joining both: the engine's `lora_overlap` did that from the
thirty-fourth sitting until the thirty-sixth, which removed it after it measured slower
on an H100 in CUDA-graph and eager steps (benchmarks/README.md). This probe times one
Llama-3-8B layer (bf16, CUDA-graph replay, weights and inputs rotated past L2, the
step's one workspace memset in each replay) three ways, on the decode shapes the kernel
targets miss (grouped_mm_probe.SHAPES) and a few more:

  base      torch.mm(x, W^T): the layer's own GEMM
  serial    the GEMM, then kernels.lora_shrink_expand (the default layer)
  overlap   the shrink on a side stream beside the GEMM, then kernels.lora_expand

and prints what LoRA adds over the GEMM each way (serial - base, overlap - base), with
the floor of the LoRA bytes (shrink + expand, at the copy bandwidth measured in the same
run) beside them; `err` is max |y_overlap - y_serial| / max |y_serial - y_base| (the
fp32 atomics of a split-K shrink may sum in either order).

    python3 benchmarks/overlap_probe.py --out benchmarks/results/overlap_probe_h100.json

A probe, not a kernel of the library (benchmarks/README.md, "Probes").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grouped_mm_probe import SHAPES  # noqa: E402
from lora_bench import (  # noqa: E402
    DT,
    LAYERS,
    Pools,
    call_shrink,
    floor_bytes,
    lora_expand,
    lora_shrink_expand,
    make_sets,
    num_sets,
    probe_header,
    time_graph,
)

MORE = [("qkv", 16, 128, 32), ("gate_up", 16, 128, 32), ("down", 16, 128, 32), ("o", 16, 128, 32)]
WEIGHT_COPIES = 3
"""Base weights rotated between calls (each layer's W is 33-235 MB: three copies pass L2)."""


class Layer:
    """One rotated call: set st (x, y, pool, meta), base weight w and a workspace view."""

    def __init__(self, st: dict, w: torch.Tensor, ws: torch.Tensor, side: torch.cuda.Stream):
        self.st, self.w, self.ws, self.side = st, w, ws, side

    def base(self) -> torch.Tensor:
        return torch.mm(self.st["x"], self.w.t())

    def serial(self) -> torch.Tensor:
        st = self.st
        y = self.base()
        lora_shrink_expand(y, st["x"], st["pool"].a, st["pool"].b, st["meta"], workspace=self.ws)
        return y

    def overlap(self) -> torch.Tensor:
        st, here = self.st, torch.cuda.current_stream()
        self.side.wait_stream(here)
        with torch.cuda.stream(self.side):
            call_shrink(st, out=self.ws)
        y = self.base()
        here.wait_stream(self.side)
        return lora_expand(y, self.ws, st["pool"].b, st["meta"])


def run_shape(layer: str, rank: int, tokens: int, n: int, bw: float) -> dict:
    hidden, sizes = LAYERS[layer]
    floor = floor_bytes(layer, tokens, n, rank, rank)
    nsets = num_sets(floor)
    sets, _ = make_sets(
        layer, Pools(layer, rank), tokens, n, nsets, lambda i: rank, expected_slots=n
    )
    weights = [
        (torch.randn(sum(sizes), hidden, device="cuda") * hidden**-0.5).to(DT)
        for _ in range(WEIGHT_COPIES)
    ]
    calls = math.lcm(nsets, WEIGHT_COPIES)  # no call meets the weight it had a replay ago
    size = len(sizes) * tokens * rank
    ws = torch.zeros(calls * size, dtype=torch.float32, device="cuda")
    side = torch.cuda.Stream()
    layers = [
        Layer(sets[k % nsets], weights[k % WEIGHT_COPIES], ws[k * size : (k + 1) * size]
              .view(len(sizes), tokens, rank), side)
        for k in range(calls)
    ]  # fmt: skip
    row = {"layer": layer, "rank": rank, "T": tokens, "n": n, "sets": nsets, "calls": calls}
    row["lora_floor_us"] = floor["both"] / bw * 1e6
    row["base_us"] = time_graph([c.base for c in layers])
    row["serial_us"] = time_graph([c.serial for c in layers], prologue=ws.zero_)
    row["overlap_us"] = time_graph([c.overlap for c in layers], prologue=ws.zero_)
    row["lora_serial_us"] = row["serial_us"] - row["base_us"]
    row["lora_overlap_us"] = row["overlap_us"] - row["base_us"]
    c = layers[0]
    base = c.base().float()
    ws.zero_()
    want = c.serial().float()
    ws.zero_()
    got = c.overlap().float()
    torch.cuda.synchronize()
    row["err"] = float((got - want).abs().max() / (want - base).abs().max())
    del layers, sets, weights, ws, c, base, want, got
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--budget-s", type=float, default=150)
    args = ap.parse_args()
    torch.manual_seed(0)
    bw, doc = probe_header()
    doc["rows"] = []
    t0 = time.monotonic()
    print(
        "shape                  |  base | LoRA floor | LoRA serial | LoRA overlap | err", flush=True
    )
    for layer, rank, tokens, n in SHAPES + MORE:
        if time.monotonic() - t0 > args.budget_s:
            print(f"budget spent: skipping {layer} r{rank} T={tokens} n={n}", flush=True)
            continue
        r = run_shape(layer, rank, tokens, n, bw)
        doc["rows"].append(r)
        name = f"{layer} r{rank} T={tokens} n={n}"
        print(f"{name:22s} | {r['base_us']:5.1f} | {r['lora_floor_us']:10.2f} | "
              f"{r['lora_serial_us']:11.2f} | {r['lora_overlap_us']:12.2f} | {r['err']:.1e}",
              flush=True)  # fmt: skip
        if args.out:
            args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
