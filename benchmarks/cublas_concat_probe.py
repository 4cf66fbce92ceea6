"""What would the shrink cost inside a cuBLAS base GEMM? (GPU probe.)

The notes on the kernel misses (results/lora_kernels_h200.json, notes_on_misses) say the
decode misses close only with the LoRA work inside a cuBLAS-speed base GEMM, a change of
the kernel contract. The simplest such design needs no kernel of our own: stack the
adapters' A under the base weight, so one cuBLAS GEMM computes y_base and every row's
shrink against every stacked slot, [T, N + k*S*R] = x @ [W; A_1; ...; A_k]^T (S slices,
rank R), and the expand then reads each row's own slot's columns. This probe measures the
GEMM's extra cost per shape (bf16, Llama-3-8B layers, CUDA-graph replay, weights rotated
past L2) against the library's shrink, which it would replace:

  base           torch.mm(x, W^T): the layer's own GEMM
  +active        x @ [W; A of the n active slots]^T: the increment over base (the best
                 case: an engine would have to keep a step's adapters stacked, a copy
                 each time the set changes)
  +pool          x @ [W; A of all 64 slots]^T: the increment over base (no copies: the
                 slot pool itself stacked under W)
  lorafleet      kernels.lora_shrink alone, as the engine runs it (rows gathered)
  both           kernels.lora_shrink_expand (shrink + expand), for scale
  layer          the whole LoRA layer of the +pool design, over base: the stacked GEMM,
                 each row's own slot's columns gathered into the expand's fp32 input
                 (one torch indexing kernel), then kernels.lora_expand
  direct         the same layer with the expand reading its rows' columns out of the
                 GEMM's output itself and adding into y = its first N columns, in place
                 (`kernels.lora_expand_stacked`; the recorded run used a copy of it in
                 benchmarks/ before it joined the library): no launch but the GEMM's
                 and the expand's

The stacked columns come out in bf16 (the contract's shrink output is fp32): the probe
times the design, it does not make it correct.

    python3 benchmarks/cublas_concat_probe.py --out benchmarks/results/cublas_concat_probe_h100.json

A probe, not a kernel of the library (benchmarks/README.md, "Probes").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grouped_mm_probe import SHAPES  # noqa: E402
from lora_bench import (  # noqa: E402
    DT,
    LAYERS,
    Pools,
    call_both,
    call_shrink,
    floor_bytes,
    lora_expand,
    lora_shrink_expand,
    make_sets,
    num_sets,
    probe_header,
    time_graph,
    workspaces,
)

WEIGHT_COPIES = 3
"""Base weights rotated between calls (each layer's W is 8-235 MB: three copies pass L2)."""


def stacked(st: dict, weight: torch.Tensor, active_only: bool) -> torch.Tensor:
    """[W; A...] as one [N + k*S*R, H] operand: the active slots' A (or the whole pool's)."""
    slots = st["slots"].unique()
    slots = slots[slots >= 0]
    parts = [a[slots] if active_only else a for a in st["pool"].a]  # [k, R, H] per slice
    return torch.cat([weight, *(p.reshape(-1, p.shape[-1]) for p in parts)])


def stacked_layer(st: dict, cat: torch.Tensor, n_base: int, buf: torch.Tensor, rows) -> None:
    """The +pool design's layer: y_ext = x @ [W; pool A]^T, the row's slot's columns
    gathered to the expand's fp32 [slices, T, R] input, lora_expand into y."""
    tokens, slices, rank = buf.shape[1], buf.shape[0], buf.shape[2]
    out = torch.mm(st["x"], cat.t())
    h = out[:, n_base:].view(tokens, slices, -1, rank)  # columns: (slice, slot, r)
    buf.copy_(h[rows, :, st["slots"].clamp_min(0)].permute(1, 0, 2))
    lora_expand(st["y"], buf, st["pool"].b, st["meta"])


def direct_layer(st: dict, cat: torch.Tensor, n_base: int) -> torch.Tensor:
    """The +pool layer with the expand reading the GEMM's columns: out[:, :N] is y."""
    out = torch.mm(st["x"], cat.t())
    kernels.lora_expand_stacked(out, n_base, st["pool"].b, st["meta"])
    return out


def direct_err(st: dict, weight: torch.Tensor, cat: torch.Tensor, n_base: int) -> float:
    """Max |y_direct - y_library| / max |y_library - y_base|: the LoRA term's error, y
    from the base GEMM plus kernels.lora_shrink_expand as the reference."""
    base = torch.mm(st["x"], weight.t())
    want = base.clone()
    lora_shrink_expand(want, st["x"], st["pool"].a, st["pool"].b, st["meta"])
    got = direct_layer(st, cat, n_base)[:, :n_base]
    delta = (want.float() - base.float()).abs().max()
    return float((got.float() - want.float()).abs().max() / delta)


def run_shape(layer: str, rank: int, tokens: int, n: int) -> dict:
    hidden, sizes = LAYERS[layer]
    nsets = num_sets(floor_bytes(layer, tokens, n, rank, rank))
    sets, _ = make_sets(
        layer, Pools(layer, rank), tokens, n, nsets, lambda i: rank, expected_slots=n
    )
    memset, views = workspaces(sets, layer, rank)
    pairs = list(zip(sets, views, strict=True))
    x = sets[0]["x"]
    weights = [
        (torch.randn(sum(sizes), hidden, device="cuda") * hidden**-0.5).to(DT)
        for _ in range(WEIGHT_COPIES)
    ]
    row = {"layer": layer, "rank": rank, "T": tokens, "n": n, "sets": nsets}
    row["base_us"] = time_graph([lambda w=w: torch.mm(x, w.t()) for w in weights])
    for name, active in (("active", True), ("pool", False)):
        cats = [stacked(sets[i % nsets], w, active) for i, w in enumerate(weights)]
        row[f"with_{name}_us"] = time_graph([lambda c=c: torch.mm(x, c.t()) for c in cats])
        row[f"extra_{name}_us"] = row[f"with_{name}_us"] - row["base_us"]
        if not active:
            n_base, rows = sum(sizes), torch.arange(tokens, device="cuda")
            bufs = [torch.empty_like(st["buf"]) for st in sets]
            layer_fns = [
                lambda st=sets[i % nsets], c=c, b=bufs[i % nsets], nb=n_base, r=rows: stacked_layer(
                    st, c, nb, b, r
                )
                for i, c in enumerate(cats)
            ]
            row["layer_pool_us"] = time_graph(layer_fns) - row["base_us"]
            stacked_layer(sets[0], cats[0], n_base, bufs[0], rows)
            want = sets[0]["buf"]
            row["layer_rel_err"] = float((bufs[0] - want).abs().max() / want.abs().max())
            row["direct_pool_us"] = (
                time_graph(
                    [
                        lambda st=sets[i % nsets], c=c, nb=n_base: direct_layer(st, c, nb)
                        for i, c in enumerate(cats)
                    ]
                )
                - row["base_us"]
            )
            row["direct_rel_err"] = direct_err(sets[0], weights[0], cats[0], n_base)
        del cats
    row["lorafleet_shrink_us"] = time_graph(
        [lambda p=p: call_shrink(p[0], out=p[1]) for p in pairs], prologue=memset
    )
    row["lorafleet_both_us"] = time_graph([lambda st=st: call_both(st) for st in sets])
    del sets, views, pairs, weights
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--budget-s", type=float, default=240)
    args = ap.parse_args()
    torch.manual_seed(0)
    _, doc = probe_header()
    doc["rows"] = []
    t0 = time.monotonic()
    print(
        "shape                  |  base | +active | +pool | lorafleet shrink | both  | layer (+pool) | err",
        flush=True,
    )
    for layer, rank, tokens, n in SHAPES:
        if time.monotonic() - t0 > args.budget_s:
            print(f"budget spent: skipping {layer} r{rank} T={tokens} n={n}", flush=True)
            continue
        r = run_shape(layer, rank, tokens, n)
        doc["rows"].append(r)
        name = f"{layer} r{rank} T={tokens} n={n}"
        print(f"{name:22s} | {r['base_us']:5.1f} | {r['extra_active_us']:7.2f} | "
              f"{r['extra_pool_us']:5.2f} | {r['lorafleet_shrink_us']:16.2f} | "
              f"{r['lorafleet_both_us']:5.2f} | {r['layer_pool_us']:13.2f} | "
              f"{r['direct_pool_us']:6.2f} | {r['direct_rel_err']:.1e}", flush=True)  # fmt: skip
        if args.out:
            args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
