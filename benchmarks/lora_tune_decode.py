"""Decode launch-config data for the LoRA kernels (GPU), run through
benchmarks/lora_kernels.py --tune (benchmarks/lora_tune.py):

    python3 benchmarks/lora_kernels.py --no-grid --tune --tune-kinds decode [--tune-ranks 64] --out FILE
    python3 benchmarks/lora_kernels.py --no-grid --tune --tune-kinds copies --out FILE
    python3 benchmarks/lora_kernels.py --no-grid --tune --tune-kinds hint --out FILE

`tune_decode`: the shrink alone by its K splits and the expand alone by its widths at
decode (what kernels/triton/shrink_plan.py's decode split and lora_expand.py's decode
widths are chosen from). `tune_hint`: shrink + expand by SegmentMeta.expected_slots, or
(copies) by kernels.meta.MAX_TILE_COPIES.
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch

from benchmarks.lora_bench import (
    LAYERS,
    Pools,
    call_both,
    call_expand,
    call_shrink,
    config_expand_err,
    config_shrink_err,
    default_shrink,
    expecting,
    floor_bytes,
    make_sets,
    num_sets,
    time_config,
    time_graph,
    workspaces,
)

HINT_SHAPES = [  # layer, rank, T, n: decode and T=1024 with few to many adapters
    (layer, rank, tokens, n)
    for layer in ("qkv", "o", "gate_up", "down")
    for rank in (16, 64)
    for tokens, n in ((16, 8), (64, 1), (64, 8), (64, 32), (64, 64), (256, 1), (256, 8),
                      (256, 32), (256, 64), (1024, 1), (1024, 8))
]  # fmt: skip


DECODE_SHAPES = [  # layer, rank, T, n: decode steps from one to many adapters
    ("qkv", 16, 64, 1), ("qkv", 16, 64, 8), ("qkv", 16, 64, 32), ("qkv", 16, 64, 64),
    ("qkv", 16, 256, 8), ("qkv", 16, 256, 32), ("qkv", 16, 256, 64), ("o", 16, 64, 8),
    ("o", 16, 256, 64), ("down", 16, 64, 32), ("down", 16, 64, 64), ("down", 16, 256, 32),
    ("gate_up", 16, 64, 64), ("gate_up", 16, 256, 8), ("qkv", 64, 64, 32), ("o", 64, 64, 32),
    ("gate_up", 64, 64, 8), ("down", 64, 256, 8),
    # run 23 on: rank 64 from one token to many adapters
    ("qkv", 64, 1, 1), ("down", 64, 1, 1), ("qkv", 64, 64, 1), ("down", 64, 64, 1),
    ("down", 64, 64, 8), ("qkv", 64, 256, 8), ("o", 64, 256, 8), ("qkv", 64, 64, 64),
]  # fmt: skip


def _decode_shrink_configs(st: dict, layer: str, rank: int):
    """Split-K shrinks at decode by their K splits (ShrinkConfig.k_splits: how many bytes
    of A one program streams), BLOCK_K 128 and 256, 4 and 2 warps, and the default."""
    from dataclasses import replace

    base = default_shrink(st, layer, rank)
    return (
        [base]
        + [replace(base, block_k=128, k_splits=k) for k in (1, 2, 4, 8, 16, 32, 64)]
        + [replace(base, block_k=256, k_splits=k) for k in (2, 4, 8, 16)]
        + [replace(base, block_k=128, k_splits=k, num_warps=2) for k in (4, 8, 16, 32)]
        + _decode_stacked_configs(base, layer)
    )


def _decode_stacked_configs(base, layer: str):
    """Multi-slice layers (qkv, gate_up): one program for all slices with their A rows
    stacked (qkv at rank 16: q and k in one 32-row operand, v a second dot), so each
    decode x tile and tile's metadata is read once instead of once per slice; K split
    by the expected tiles (3x the splits of per-slice programs for qkv) and fixed."""
    from dataclasses import replace

    if len(LAYERS[layer][1]) == 1:
        return []
    fused = replace(base, fuse_slices=True, stack_tail=True)
    return (
        [fused, replace(fused, num_warps=4)]
        + [replace(fused, k_splits=k) for k in (8, 16, 32, 64)]
        + [replace(fused, k_splits=k, num_warps=4) for k in (16, 32)]
    )


def _decode_expand_configs(st: dict, layer: str, rank: int):
    """Expands at decode by the columns one program writes (block_n x n_iters), warps,
    and the default; late_add as the default's."""
    from dataclasses import replace

    from kernels.triton.common import block_r
    from kernels.triton.lora_expand import default_config

    base = default_config(st["meta"].block_m, block_r(rank), max(LAYERS[layer][1]))
    wide = [(64, 4, 1, 1), (128, 4, 1, 1), (256, 4, 1, 1), (512, 4, 1, 1), (512, 8, 1, 1)]
    loops = [(128, 4, 2, 2), (128, 4, 4, 2), (256, 4, 2, 2), (128, 2, 1, 1), (256, 8, 1, 1)]
    return [base] + [
        replace(base, block_n=bn, num_warps=w, n_iters=it, num_stages=stages)
        for bn, w, it, stages in wide + loops
    ]


def tune_decode(
    bw: float,
    budget_s: float,
    ranks: tuple[int, ...] = (16, 64),
    shapes=None,
    stacked_only: bool = False,
) -> list[dict]:
    """Shrink alone and expand alone per launch config on `shapes` (default DECODE_SHAPES)
    of these ranks, each step expecting its n adapters (SegmentMeta.expected_slots, as
    the engine runs them), and shrink + expand with the default configs: how many bytes
    one program should move at decode (_decode_shrink_configs, _decode_expand_configs).

    stacked_only (kind "decodestack"): multi-slice shapes only, the default shrink config
    against _decode_stacked_configs, each timed alone and as the shrink of shrink +
    expand (PDL as the engine runs it); no expand configs."""
    from kernels.triton import lora_expand as ex
    from kernels.triton import lora_shrink as sh

    rows, t0 = [], time.monotonic()
    for layer, rank, tokens, n in shapes or DECODE_SHAPES:
        if stacked_only and len(LAYERS[layer][1]) == 1:
            continue
        if rank not in ranks:
            continue
        shape = f"{layer} r{rank} T={tokens} n={n}"
        if time.monotonic() - t0 > budget_s:
            print(f"decode tune budget spent: skipping {shape}", flush=True)
            continue
        fb = floor_bytes(layer, tokens, n, rank, rank)
        pools = Pools(layer, rank)
        sets, _ = make_sets(
            layer, pools, tokens, n, num_sets(fb), lambda i, r=rank: r, expected_slots=n
        )
        memset, views = workspaces(sets, layer, rank)
        pairs = list(zip(sets, views, strict=True))
        both = [functools.partial(call_both, st, v) for st, v in pairs]
        trials = [("both", sh, None, both)]
        shrink = [functools.partial(call_shrink, st, v) for st, v in pairs]
        expand = [functools.partial(call_expand, st) for st in sets]
        if stacked_only:
            base = default_shrink(sets[0], layer, rank)
            for c in [base] + _decode_stacked_configs(base, layer):
                trials += [("shrink", sh, c, shrink), ("both", sh, c, both)]
        else:
            configs = _decode_shrink_configs(sets[0], layer, rank)
            trials += [("shrink", sh, c, shrink) for c in configs]
            configs = _decode_expand_configs(sets[0], layer, rank)
            trials += [("expand", ex, c, expand) for c in configs]
        for kind, mod, cfg, fns in trials:
            us = time_config(mod, "CONFIG_OVERRIDE", cfg, fns, None if kind == "expand" else memset)
            row = {"shape": shape, "kind": f"decode_{kind}", "config": repr(cfg), "graph_us": us,
                   "floor_us": fb[kind] / bw * 1e6}  # fmt: skip
            if kind == "expand" and cfg is not None:
                row["err_vs_default"] = config_expand_err(mod, cfg, sets[0])
            if kind == "shrink" and stacked_only:
                row["err_vs_default"] = config_shrink_err(mod, cfg, sets[0])
            rows.append(row)
            err = f" err {row['err_vs_default']:.1e}" if "err_vs_default" in row else ""
            print(f"{shape:24s} {kind:6s} {us:7.1f} us (floor {row['floor_us']:.1f}) "
                  f"{cfg or 'default'}{err}", flush=True)  # fmt: skip
        del sets, views, pools, pairs, trials, shrink, expand
        torch.cuda.empty_cache()
    return rows


def tune_hint(bw: float, copies: bool = False) -> list[dict]:
    """Graph-replay us of shrink + expand (as the engine runs them) with the tile grids
    sized for all L = 64 slots (SegmentMeta.expected_slots None: ceil(T / BLOCK_M) +
    min(L, T) tile programs, most past the device-side tile count when the batch has
    few adapters) and for expected_slots = n, 2n and 4n.

    copies: instead, expected_slots = n with kernels.meta.MAX_TILE_COPIES at 2, 4 and 8
    (a cap of c launches at least max_tiles / c tile programs), on the decode shapes;
    the kernels ignore the expectation at prefill tiles."""
    rows = []
    for layer, rank, tokens, n in HINT_SHAPES:
        if copies and tokens > 256:
            continue
        fb = floor_bytes(layer, tokens, n, rank, rank)
        pools = Pools(layer, rank)
        sets, _ = make_sets(layer, pools, tokens, n, num_sets(fb), lambda i, r=rank: r)
        memset, views = workspaces(sets, layer, rank)
        fns = [functools.partial(call_both, st, v) for st, v in zip(sets, views, strict=True)]
        shape = f"{layer} r{rank} T={tokens} n={n}"
        variants = (
            [(None, None)] + [(n, c) for c in (2, 4, 8)]
            if copies
            else [(h, None) for h in (None, n, min(2 * n, 64), min(4 * n, 64))]
        )
        for hint, cap in variants:
            with expecting(sets, hint), _max_tile_copies(cap):
                us = time_graph(fns, 10, prologue=memset)
            rows.append({"shape": shape, "kind": "copies" if copies else "hint",
                         "expected_slots": hint, "max_tile_copies": cap, "graph_us": us,
                         "floor_us": fb["both"] / bw * 1e6})  # fmt: skip
            print(f"{shape:24s} hint {hint!s:4s} copies {cap!s:4s} {us:7.1f} us "
                  f"(floor {rows[-1]['floor_us']:.1f})", flush=True)  # fmt: skip
        del sets, views, pools
        torch.cuda.empty_cache()
    return rows


@contextlib.contextmanager
def _max_tile_copies(cap: int | None):
    """kernels.meta.MAX_TILE_COPIES = cap inside the block (None: as it is)."""
    from kernels import meta

    before = meta.MAX_TILE_COPIES
    meta.MAX_TILE_COPIES = before if cap is None else cap
    try:
        yield
    finally:
        meta.MAX_TILE_COPIES = before
