"""Paged attention on the GPU: kernels.paged_attention's Triton kernel against the torch
path it replaced (replica/layers/attention.py: each sequence's block table gathered into
a dense copy, then SDPA), at Llama-3-8B's attention shape (32 query heads, 8 KV heads,
d 128, bf16, 16-token blocks), per layer.

    python3 benchmarks/attention_gpu.py --out benchmarks/results/attention_h100.json

Decode (one query per sequence): CUDA-graph replay (as decode steps run), median us a
layer; the floor printed beside each figure is the KV bytes read once (plus q and out)
at the copy bandwidth measured in the same run. Prefill (a chunk of P queries after C
cached tokens): CUDA-graph replay, median us a layer, with TFLOP/s of the causal work
(and the kernel eager, host time included, as the engine's piecewise steps run it); the
peer printed beside it is torch's SDPA on the same chunk with contiguous (unpaged) K / V,
causal: the dense flash attention a paged kernel can at best match.

Each timed call rotates over as many layers' caches as keep 180 MB in flight (three L2s),
all of one step's shape: the same block tables and contexts, another cache per layer.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels.triton.paged_attention as pa  # noqa: E402
from benchmarks.lora_bench import ROTATE_BYTES, probe_header, time_graph  # noqa: E402
from kernels import paged_attention  # noqa: E402
from kernels.attention_reference import attend_sequence, visible_keys  # noqa: E402
from kernels.testing import rel_err  # noqa: E402
from replica.layers.attention import (  # noqa: E402
    AttentionMetadata,
    _dense_prompt,
    decode_attention,
)

HEADS, KV_HEADS, D, BS = 32, 8, 128, 16
DT = torch.bfloat16
DECODE = [
    (1, 512),
    (1, 8192),
    (8, 2048),
    (32, 512),
    (32, 2048),
    (128, 160),
    (128, 512),
    (128, 2048),
]
PREFILL = [(512, 0), (1024, 0), (2048, 0), (8192, 0), (512, 1536), (512, 7680)]


def kv_bytes(seqs: int, context: int) -> int:
    """K and V of every sequence's context, one layer."""
    return seqs * context * KV_HEADS * D * 2 * DT.itemsize


def decode_floor_bytes(seqs: int, context: int) -> int:
    """What a decode layer must move at least: its KV once, q read and out written."""
    return kv_bytes(seqs, context) + 2 * seqs * HEADS * D * DT.itemsize


def causal_flops(queries: int, cached: int) -> float:
    """Multiply-adds x 2 of QK^T and PV for queries after `cached` keys, causal."""
    keys = queries * cached + queries * (queries + 1) / 2
    return 2 * 2 * HEADS * D * keys


def layers_for(bytes_per_layer: int) -> int:
    return max(1, min(32, math.ceil(ROTATE_BYTES / max(bytes_per_layer, 1))))


def _caches(layers: int, blocks: int):
    shape = (blocks, BS, KV_HEADS, D)
    return [
        (torch.randn(shape, device="cuda", dtype=DT), torch.randn(shape, device="cuda", dtype=DT))
        for _ in range(layers)
    ]


def decode_row(seqs: int, context: int, bw: float, compare: bool = True) -> dict:
    width = -(-context // BS)
    layers = layers_for(kv_bytes(seqs, context))
    caches = _caches(layers, seqs * width)
    tables = torch.randperm(seqs * width, device="cuda").view(seqs, width)
    ctx = torch.full((seqs,), context, device="cuda")
    q = torch.randn(seqs, HEADS, D, device="cuda", dtype=DT)
    out = torch.empty_like(q)
    meta = AttentionMetadata(
        torch.zeros(seqs, dtype=torch.long, device="cuda"), seqs, tables, ctx, []
    )
    scale = D**-0.5
    kern = [
        lambda c=c: paged_attention(q, c[0], c[1], tables, ctx, scale=scale, out=out)
        for c in caches
    ]
    gath = [lambda c=c: decode_attention(q, c[0], c[1], meta, scale, None) for c in caches]
    kern[0]()
    c32 = [c.float() for c in caches[0]]
    err = rel_err(out, decode_attention(q.float(), c32[0], c32[1], meta, scale, None))
    k_us = time_graph(kern)
    g_us = time_graph(gath) if compare else float("nan")
    floor = decode_floor_bytes(seqs, context) / bw * 1e6
    row = {
        "seqs": seqs, "context": context, "layers_rotated": layers, "rel_err_vs_fp32": err,
        "kernel_graph_us": k_us, "torch_gather_sdpa_graph_us": g_us, "floor_us": floor,
        "kernel_vs_floor": k_us / floor, "speedup_vs_torch": g_us / k_us,
        "kernel_TBps": decode_floor_bytes(seqs, context) / (k_us * 1e-6) / 1e12,
    }  # fmt: skip
    print(f"decode {seqs:4d} seqs x {context:5d}: kernel {k_us:8.1f} us  floor {floor:7.1f} "
          f"({k_us / floor:.2f}x)  torch gather+SDPA {g_us:8.1f} ({g_us / k_us:.1f}x the "
          f"kernel)  err {err:.1e}", flush=True)  # fmt: skip
    return row


def prefill_row(queries: int, cached: int, compare: bool = True) -> dict:
    context = queries + cached
    width = -(-context // BS)
    layers = layers_for(kv_bytes(1, context))
    caches = _caches(layers, width + 1)
    table = torch.randperm(width + 1, device="cuda")[:width]
    q = torch.randn(queries, HEADS, D, device="cuda", dtype=DT)
    out = torch.empty_like(q)
    scale = D**-0.5
    group = HEADS // KV_HEADS
    tiles = pa.prefill_tiles(
        [queries], [context], pa.tile_shape(group, DT, D, False).block_q, "cuda"
    )
    rows = [lambda c=c: paged_attention(q, c[0], c[1], table[None], [context], scale=scale,
                                        query_lens=[queries], out=out, tiles=tiles)
            for c in caches]  # fmt: skip
    mask = visible_keys(queries, context, None, "cuda")  # made once a step in the engine
    gath = [
        lambda c=c: attend_sequence(q, c[0], c[1], table, context, scale, None, mask)
        for c in caches
    ]
    dense_k = [c[0][table].flatten(0, 1)[:context].transpose(0, 1)[None] for c in caches[:2]]
    dense_v = [c[1][table].flatten(0, 1)[:context].transpose(0, 1)[None] for c in caches[:2]]
    qd = q.transpose(0, 1)[None]
    offset = torch.ones(queries, context, dtype=torch.bool, device="cuda").tril(cached)

    def sdpa(i=0):
        if cached:  # a chunk after cached keys: the causal mask is offset
            return torch.nn.functional.scaled_dot_product_attention(
                qd, dense_k[i], dense_v[i], attn_mask=offset, scale=scale, enable_gqa=True
            )
        return torch.nn.functional.scaled_dot_product_attention(
            qd, dense_k[i], dense_v[i], is_causal=True, scale=scale, enable_gqa=True)  # fmt: skip

    rows[0]()
    err = rel_err(out, sdpa()[0].transpose(0, 1))
    dense_us = dense_eager_us = float("nan")
    if not cached:  # the engine's route for whole long prompts: SDPA on the step's k / v
        kv = [
            (dk[0].transpose(0, 1).contiguous(), dv[0].transpose(0, 1).contiguous())
            for dk, dv in zip(dense_k, dense_v, strict=True)
        ]  # [n, kv_heads, d] each
        dense = [lambda c=c: out.copy_(_dense_prompt(q, c[0], c[1], scale)) for c in kv]
        dense[0]()
        assert rel_err(out, sdpa()[0].transpose(0, 1)) < 1e-2
        dense_us = time_graph(dense)
        dense_eager_us = do_bench(dense[0], warmup=3, rep=40, return_mode="median") * 1e3
    cycle = [0]

    def one():  # eager, as the engine's piecewise steps run attention: host time included
        rows[cycle[0] % len(rows)]()
        cycle[0] += 1

    e_us = do_bench(one, warmup=3, rep=40, return_mode="median") * 1e3
    k_us = time_graph(rows)
    g_us = time_graph(gath) if compare else float("nan")
    p_us = time_graph([lambda: sdpa(0), lambda: sdpa(1)])
    flops = causal_flops(queries, cached)
    row = {
        "queries": queries, "cached": cached, "rel_err_vs_sdpa": err, "kernel_us": k_us,
        "kernel_eager_us": e_us, "torch_gather_sdpa_us": g_us, "dense_sdpa_us": p_us,
        "kernel_TFLOPs": flops / (k_us * 1e-6) / 1e12, "dense_sdpa_TFLOPs": flops / (p_us * 1e-6) / 1e12,
        "speedup_vs_torch": g_us / k_us, "kernel_vs_dense_sdpa": k_us / p_us,
        "engine_dense_route_us": dense_us, "engine_dense_route_eager_us": dense_eager_us,
    }  # fmt: skip
    print(f"prefill {queries:5d} after {cached:5d}: kernel {k_us:8.1f} us "
          f"({row['kernel_TFLOPs']:.0f} TFLOP/s; eager {e_us:.1f})  dense SDPA (peer) {p_us:8.1f} "
          f"({row['dense_sdpa_TFLOPs']:.0f})  torch gather+SDPA {g_us:8.1f}  err {err:.1e}",
          flush=True)  # fmt: skip
    if not cached:
        print(f"    whole prompt through the engine's dense route (SDPA + copy into out): "
              f"{dense_us:8.1f} us ({flops / (dense_us * 1e-6) / 1e12:.0f} TFLOP/s; eager "
              f"{dense_eager_us:.1f}) against the kernel's {k_us:.1f}", flush=True)  # fmt: skip
    return row


SWEEP_DECODE = [
    (16, 64, 4, 2),
    (16, 64, 4, 2, "unmasked"),
    (16, 64, 4, 3),
    (16, 128, 4, 2),
    (16, 128, 8, 2),
    (16, 32, 4, 3),
    (16, 64, 2, 2),
]  # rows, keys, warps, stages
SWEEP_PREFILL = [(64, 64, 4, 2), (64, 64, 4, 2, "unmasked"), (64, 64, 4, 2, "in order"),
                 (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2),
                 (64, 128, 8, 2), (128, 32, 4, 3), (64, 32, 4, 3)]  # fmt: skip
"""rows, keys, warps, stages[, "unmasked": whole key steps unmasked (UNMASKED_FULL on),
"masked": every step masked (off), "in order": prefill tiles in query order (LONGEST_FIRST
off); without one, the module's settings]."""


def sweep(decode, prefill, bw: float) -> list[dict]:
    """Each tile shape and launch option of SWEEP_* on each shape (the first is the default)."""
    rows = []
    shape_fn, launch = pa.tile_shape, {k: dict(v) for k, v in pa.LAUNCH.items()}
    flags = pa.UNMASKED_FULL, pa.LONGEST_FIRST
    kinds = [("decode", s, c, SWEEP_DECODE) for s, c in decode]
    kinds += [("prefill", q, c, SWEEP_PREFILL) for q, c in prefill]
    try:
        for kind, a, b, grid in kinds:
            for m, n, w, st, *variant in grid:
                q_tile = 1 if kind == "decode" else max(1, m // (HEADS // KV_HEADS))
                pa.tile_shape = lambda *_, t=pa.Tiles(m, n, q_tile): t
                pa.LAUNCH[kind] = dict(num_warps=w, num_stages=st)
                pa.UNMASKED_FULL = {"unmasked": True, "masked": False}.get(
                    "".join(variant), flags[0]
                )
                pa.LONGEST_FIRST = flags[1] and "in order" not in variant
                r = decode_row(a, b, bw, False) if kind == "decode" else prefill_row(a, b, False)
                us = r["kernel_graph_us"] if kind == "decode" else r["kernel_us"]
                rows.append({"kind": kind, "shape": [a, b], "rows": m, "keys": n, "warps": w,
                             "stages": st, "variant": "".join(variant), "us": us})  # fmt: skip
                print(f"  sweep {kind} {a}x{b}: rows {m} keys {n} warps {w} stages {st} "
                      f"{''.join(variant)}: {us:.1f} us", flush=True)  # fmt: skip
    finally:
        pa.tile_shape = shape_fn
        pa.LAUNCH.update(launch)
        pa.UNMASKED_FULL, pa.LONGEST_FIRST = flags
    return rows


def parse_pairs(text: str, default):
    """ "AxB,AxB" -> [(A, B), ...]; "" -> default."""
    if not text:
        return default
    pairs = [p.split("x") for p in text.split(",")]
    if any(len(p) != 2 or not all(v.isdigit() for v in p) for p in pairs):
        raise SystemExit(f"expected AxB,AxB... (positive ints): {text!r}")
    return [(int(a), int(b)) for a, b in pairs]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decode", default="", help="seqsxcontext,... (default: the built-in set)")
    ap.add_argument("--prefill", default="", help="queriesxcached,...")
    ap.add_argument("--sweep", action="store_true", help="tile shapes and launch options instead")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("attention_gpu.py needs a CUDA device")
    decode, prefill = parse_pairs(args.decode, DECODE), parse_pairs(args.prefill, PREFILL)
    bw, header = probe_header()
    result = {
        **header,
        "shape": dict(heads=HEADS, kv_heads=KV_HEADS, d=D, block_size=BS, dtype=str(DT)),
    }
    if args.sweep:
        result["sweep"] = sweep(decode, prefill, bw)
        decode = prefill = []
    result["decode"] = [decode_row(s, c, bw) for s, c in decode]
    result["prefill"] = [prefill_row(q, c) for q, c in prefill]
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
