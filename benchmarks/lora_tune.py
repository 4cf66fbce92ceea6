"""Launch-config data for the LoRA kernels (GPU), run through benchmarks/lora_kernels.py:

    python3 benchmarks/lora_kernels.py --no-grid --tune [--tune-kinds shrink] [--tune-max-tokens 256]
        [--tune-min-tokens 1024] [--tune-ranks 64] --out FILE
    python3 benchmarks/lora_kernels.py --no-grid --tune-block-m [--tune-block-m-prefill] --out FILE
    python3 benchmarks/lora_kernels.py --no-grid --sweep

`tune`: graph-replay us of the separate shrink and expand kernels per ShrinkConfig /
ExpandConfig (what default_config in kernels/triton/shrink_plan.py and lora_expand.py is
chosen from), shrink+expand with and without programmatic dependent launch, and (kind
"layout") B rank-major against n-major. `tune_block_m`: tile heights (what
kernels.meta.default_block_m is chosen from). `sweep`: the opt-in fused kernel per FusedTuning.
"""

from __future__ import annotations

import functools
import time

import torch

from benchmarks.lora_bench import (
    LAYERS,
    Pools,
    call_both,
    call_expand,
    call_fused,
    call_shrink,
    config_expand_err,
    default_shrink,
    floor_bytes,
    make_sets,
    num_sets,
    pdl,
    time_config,
    time_graph,
    workspaces,
)
from benchmarks.lora_tune_decode import tune_decode, tune_hint

SWEEP_SHAPES = [
    ("o", 16, 64, 8),
    ("qkv", 16, 64, 8),
    ("qkv", 16, 64, 32),
    ("qkv", 16, 256, 32),
    ("gate_up", 16, 128, 32),
    ("qkv", 64, 256, 32),
    ("down", 64, 256, 32),
    ("o", 16, 2048, 32),
    ("qkv", 64, 4096, 8),
    ("gate_up", 64, 4096, 64),
    ("down", 16, 4096, 8),
]
# FusedTuning fields: (shrink items/program, expand items/program, block_n, warps, stages,
# block_k (0 = auto), fuse slices, max programs per SM)
SWEEP_DECODE = [
    (1, 1, 128, 4, 3, 0, True, 4), (0.5, 1, 128, 4, 3, 0, True, 4),
    (1, 0.5, 128, 4, 3, 0, True, 4), (2, 1, 128, 4, 3, 0, True, 4),
    (1, 2, 128, 4, 3, 0, True, 4), (1, 1, 128, 8, 3, 0, True, 4),
    (1, 1, 128, 4, 3, 128, True, 4), (1, 1, 128, 4, 3, 0, False, 4),
    (1, 1, 128, 4, 3, 0, True, 1),
]  # fmt: skip
SWEEP_PREFILL = [
    (2, 4, 128, 4, 3, 0, True, 4), (1, 2, 128, 4, 3, 0, True, 4),
    (1, 4, 128, 4, 3, 0, True, 4), (2, 8, 128, 4, 3, 0, True, 4),
    (2, 4, 128, 8, 3, 0, True, 4), (2, 4, 256, 8, 3, 0, True, 4),
    (2, 4, 128, 4, 3, 0, False, 4), (2, 4, 128, 4, 3, 0, True, 1),
]  # fmt: skip


def sweep(bw: float, budget_s: float) -> list[dict]:
    """Graph-replay us of the fused kernel per tuning on a few shapes (tuning data)."""
    from kernels.triton import lora_fused as fu

    rows, t0 = [], time.monotonic()
    for layer, rank, tokens, n in SWEEP_SHAPES:
        if time.monotonic() - t0 > budget_s:
            print(f"sweep budget spent: skipping {layer} r{rank} T={tokens}", flush=True)
            continue
        pools = Pools(layer, rank)
        fb = floor_bytes(layer, tokens, n, rank, rank)
        sets, _ = make_sets(layer, pools, tokens, n, num_sets(fb), lambda i, r=rank: r)
        for knobs in SWEEP_DECODE if tokens <= 256 else SWEEP_PREFILL:
            tuning = fu.FusedTuning(*knobs)
            fns = [functools.partial(call_fused, st) for st in sets]
            us = time_config(fu, "TUNING_OVERRIDE", tuning, fns)
            rows.append({"shape": f"{layer} r{rank} T={tokens} n={n}", "tuning": repr(tuning),
                         "graph_us": us, "floor_us": fb["both"] / bw * 1e6})  # fmt: skip
            print(f"{rows[-1]['shape']:24s} {us:7.1f} us (floor {rows[-1]['floor_us']:.1f}) {knobs}",
                  flush=True)  # fmt: skip
        del sets, pools
    return rows


TUNE_SHAPES = [
    ("o", 16, 64, 8), ("qkv", 16, 64, 8), ("gate_up", 16, 64, 8), ("qkv", 16, 256, 32),
    ("down", 16, 256, 32), ("qkv", 64, 256, 32), ("gate_up", 64, 256, 8),
    ("o", 16, 1024, 8), ("gate_up", 16, 1024, 8), ("down", 64, 1024, 32), ("qkv", 64, 1024, 32),
    ("qkv", 16, 2048, 8), ("qkv", 16, 4096, 8), ("o", 16, 4096, 8), ("gate_up", 16, 4096, 32),
    ("down", 64, 4096, 32), ("qkv", 64, 4096, 8), ("gate_up", 64, 4096, 8),
]  # fmt: skip


BLOCK_M_SHAPES = [
    ("o", 16, 64, 8), ("qkv", 16, 256, 32), ("qkv", 64, 256, 1), ("qkv", 64, 256, 8),
    ("o", 64, 256, 8), ("down", 64, 256, 8), ("gate_up", 16, 256, 8), ("down", 16, 256, 32),
]  # fmt: skip
BLOCK_M_PREFILL_SHAPES = [
    ("o", 16, 4096, 8), ("qkv", 16, 4096, 8), ("down", 16, 4096, 8), ("gate_up", 16, 4096, 32),
    ("qkv", 64, 4096, 8), ("o", 16, 1024, 8), ("gate_up", 64, 1024, 1), ("gate_up", 64, 1024, 8),
    ("qkv", 64, 1024, 32), ("down", 64, 1024, 32), ("o", 64, 1024, 8), ("qkv", 64, 512, 8),
]  # fmt: skip


def parse_shapes(text: str) -> list[tuple[str, int, int, int]]:
    """'layer:rank:T:n,...' (e.g. 'qkv:64:1024:16,o:64:512:8') -> [(layer, rank, T, n)]."""
    shapes = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 4 or parts[0] not in LAYERS or not all(p.isdigit() for p in parts[1:]):
            raise ValueError(
                f"shape {item!r}; allowed: layer:rank:T:n with layer in {list(LAYERS)}"
            )
        shapes.append((parts[0], int(parts[1]), int(parts[2]), int(parts[3])))
    return shapes


def tune_block_m(
    bw: float, prefill: bool = False, shapes=None, heights=None, kinds=("both", "shrink", "expand")
) -> list[dict]:
    """Graph-replay us per tile height (rows per tile: how often a slot's A and B are
    re-read from L2, and how long each x row read is): shrink+expand with the default
    configs (PDL as the engine runs it) and, with prefill (32 and 64 rows; 16 was slower
    for every layer in run 11, 128 in run 17), the shrink and the expand alone. Run 11
    also timed per-slice shrinks with BLOCK_K 256-512 here: slower everywhere, since
    dropped."""
    from kernels.triton import lora_shrink as sh

    rows = []
    shapes = shapes or (BLOCK_M_PREFILL_SHAPES if prefill else BLOCK_M_SHAPES)
    for layer, rank, tokens, n in shapes:
        fb = floor_bytes(layer, tokens, n, rank, rank)
        shape = f"{layer} r{rank} T={tokens} n={n}"
        pools = Pools(layer, rank)
        for bm in heights or ((32, 64) if prefill else (16, 32, 64)):
            sets, _ = make_sets(layer, pools, tokens, n, num_sets(fb), lambda i, r=rank: r, bm)
            memset, views = workspaces(sets, layer, rank)
            pairs = list(zip(sets, views, strict=True))
            trials = [("both", None, [functools.partial(call_both, st, v) for st, v in pairs])]
            if prefill:
                shrink = [functools.partial(call_shrink, st, v) for st, v in pairs]
                trials += [("shrink", None, shrink)]
                trials += [("expand", None, [functools.partial(call_expand, st) for st in sets])]
            trials = [t for t in trials if t[0] in kinds]
            for kind, cfg, fns in trials:
                prologue = None if kind == "expand" else memset
                us = time_config(sh, "CONFIG_OVERRIDE", cfg, fns, prologue)
                rows.append({"shape": shape, "kind": kind, "block_m": bm, "config": repr(cfg),
                             "graph_us": us, "floor_us": fb[kind] / bw * 1e6})  # fmt: skip
                print(f"{shape:24s} {kind:6s} block_m={bm:3d} {us:7.1f} us "
                      f"(floor {rows[-1]['floor_us']:.1f}) {cfg or 'default'}", flush=True)  # fmt: skip
            del sets, views
        del pools
        torch.cuda.empty_cache()
    return rows


def _shrink_configs(prefill: bool):
    """The split-K grid (what runs 1-5 of results/lora_kernels_tune_h200.json chose from:
    finer K splits were slower at every prefill shape) against persistent stream-K
    launches (ShrinkConfig.stream_k; 5 stages = 3 x / A buffers, 2 items in flight)."""
    from kernels.triton.lora_shrink import ShrinkConfig

    if not prefill:  # per-slice programs (fused slices lost at decode: --tune of 2026-12-02)
        grid = [ShrinkConfig(128, 32, False), ShrinkConfig(128, 16, False)]
        return grid + [ShrinkConfig(128, p, False, 5, stream_k=True) for p in (4, 8, 16)]
    grid = [ShrinkConfig(bk, 4, fuse) for bk in (128, 256) for fuse in (False, True)]
    grid += [ShrinkConfig(64, 4, True), ShrinkConfig(128, 8, True), ShrinkConfig(64, 8, True)]
    # stacked fused slices at rank 64 (qkv: 3 x 64 rows in one 256-row operand, x read
    # once), 8 warps for the [BLOCK_M, 256] accumulator
    grid += [ShrinkConfig(bk, 4, True, st, 8) for bk, st in ((64, 3), (64, 2), (32, 4))]
    stream = [
        ShrinkConfig(bk, p, fuse, 5, stream_k=True)
        for bk in (64, 128)
        for p in (2, 3, 4)
        for fuse in (False, True)
    ]
    wide = [
        ShrinkConfig(256, 1, False, 5, stream_k=True),
        ShrinkConfig(256, 2, False, 4, stream_k=True),
    ]
    warps8 = [ShrinkConfig(bk, p, False, 5, 8, stream_k=True) for bk, p in ((128, 2), (64, 3))]
    return grid + stream + wide + warps8 + [ShrinkConfig(128, 3, False, 4, stream_k=True)]


def _lean_configs(st: dict, layer: str, rank: int):
    """The shape's default shrink config with x read lean (ShrinkConfig.lean_x, the
    default) and with the row mask and 64-bit offsets."""
    from dataclasses import replace

    base = default_shrink(st, layer, rank)
    return [replace(base, lean_x=True), replace(base, lean_x=False)]


def _stack_configs(st: dict, layer: str, rank: int):
    """Fused-slices split-K shrinks (prefill, rank <= 32): the shape's default config with
    the slices' A rows stacked into one dot (ShrinkConfig.stack_slices) and without, and
    stacked with more or fewer K splits and a deeper pipeline."""
    from dataclasses import replace

    base = default_shrink(st, layer, rank)
    if base.stream_k or not base.fuse_slices:
        return []
    return [
        replace(base, stack_slices=True),
        replace(base, stack_slices=False),
        replace(base, programs_per_sm=2),
        replace(base, programs_per_sm=8),
        replace(base, num_stages=4),
    ]


def _long_k_configs(st: dict, layer: str, rank: int):
    """Prefill at rank >= 64: the default (stream-K) against per-slice split-K grids whose
    programs walk all of K, or half, in one loop (ShrinkConfig.max_k_per_split = H)."""
    from kernels.triton.lora_shrink import ShrinkConfig

    base = default_shrink(st, layer, rank)
    if not base.stream_k:
        return []
    hidden = LAYERS[layer][0]
    return [base] + [
        ShrinkConfig(bk, per_sm, False, stages, max_k_per_split=hidden)
        for bk, per_sm, stages in ((128, 1, 3), (128, 2, 3), (64, 2, 4), (64, 4, 3))
    ]


def _late_configs(st: dict, layer: str, rank: int):
    """The shape's default expand config with ExpandConfig.late_add on and off."""
    from dataclasses import replace

    from kernels.triton.common import block_r
    from kernels.triton.lora_expand import default_config

    base = default_config(st["meta"].block_m, block_r(rank), max(LAYERS[layer][1]))
    return [replace(base, late_add=True), replace(base, late_add=False)]


def _expand_configs(prefill: bool):
    """(block_n, warps), then several blocks per program (n_iters, pipelined by
    num_stages) at the widths that fit the registers (lora_expand.ExpandConfig)."""
    from kernels.triton.lora_expand import ExpandConfig

    if not prefill:
        return [ExpandConfig(*c) for c in ((128, 4), (256, 4), (128, 2), (256, 8),
                                            (64, 4, 2, 2), (128, 4, 2, 2))]  # fmt: skip
    return [ExpandConfig(*c) for c in ((64, 4), (128, 4), (128, 8), (256, 8), (64, 4, 4, 2),
                                       (64, 4, 4, 3), (128, 4, 2, 2), (128, 4, 4, 2),
                                       (128, 8, 4, 2), (128, 8, 2, 3))]  # fmt: skip


FLOOR_OF = {"expand": "expand", "late": "expand", "lateboth": "both"}
"""The byte floor a tune kind is held against (the shrink's where not named)."""


def tune(
    bw: float,
    budget_s: float,
    kinds: tuple[str, ...] = ("both", "shrink", "expand"),
    max_tokens: int = 1 << 30,
    min_tokens: int = 0,
    ranks: tuple[int, ...] = (16, 64),
    shapes=None,
) -> list[dict]:
    """Graph-replay us of the separate shrink and expand kernels per launch config on
    `shapes` (default TUNE_SHAPES): what kernels/triton/shrink_plan.py / lora_expand.py
    default_config use.
    kinds: "both" (shrink + expand with and without PDL), "shrink", "expand", and
    "layout" (also B n-major, the layout before rank-major), "lean" (the default shrink
    config with ShrinkConfig.lean_x on and off), "stack" (_stack_configs), "longk"
    (_long_k_configs), "late" / "lateboth" (the default expand config with
    ExpandConfig.late_add on and off: the expand alone / shrink + expand as the engine
    runs them), "hint" (tune_hint, its own shapes), "decode" / "decodestack" (tune_decode: decode
    launch configs / stacked all-slice decode shrinks), "copies" (tune_hint's decode shapes
    with kernels.meta.MAX_TILE_COPIES 2 / 4 / 8)."""
    from kernels.triton import lora_expand as ex
    from kernels.triton import lora_shrink as sh

    rows, t0 = tune_hint(bw) if "hint" in kinds else [], time.monotonic()
    if "decode" in kinds:
        rows += tune_decode(bw, budget_s, ranks)
    if "decodestack" in kinds:
        rows += tune_decode(bw, budget_s, ranks, shapes, stacked_only=True)
    if "copies" in kinds:
        rows += tune_hint(bw, copies=True)
    if set(kinds) <= {"hint", "copies", "decode", "decodestack"}:
        return rows
    for layer, rank, tokens, n in shapes or TUNE_SHAPES:
        if not min_tokens <= tokens <= max_tokens or rank not in ranks:
            continue
        if time.monotonic() - t0 > budget_s:
            print(f"tune budget spent: skipping {layer} r{rank} T={tokens}", flush=True)
            continue
        fb = floor_bytes(layer, tokens, n, rank, rank)
        shape = f"{layer} r{rank} T={tokens} n={n}"
        for rank_major in (True, False) if "layout" in kinds else (True,):
            pools = Pools(layer, rank, rank_major)
            sets, _ = make_sets(layer, pools, tokens, n, num_sets(fb), lambda i, r=rank: r)
            memset, views = workspaces(sets, layer, rank)
            ws_fns = [
                functools.partial(call_both, st, v) for st, v in zip(sets, views, strict=True)
            ]
            for on in (True, False) if "both" in kinds else ():
                with pdl(on):
                    us = time_graph(ws_fns, 10, prologue=memset)
                rows.append({"shape": shape, "kind": "both", "b_rank_major": rank_major,
                             "pdl": on, "graph_us": us, "floor_us": fb["both"] / bw * 1e6})  # fmt: skip
                print(f"{shape:24s} both   {'rm' if rank_major else 'nm'} pdl={int(on)} {us:7.1f} us "
                      f"(floor {rows[-1]['floor_us']:.1f})", flush=True)  # fmt: skip
            trials = [("expand", ex, c) for c in _expand_configs(tokens > 256)]
            if rank_major:
                trials += [("shrink", sh, c) for c in _shrink_configs(tokens > 256)]
            for kind, configs in (("lean", _lean_configs), ("stack", _stack_configs),
                                  ("longk", _long_k_configs)):  # fmt: skip
                if kind in kinds:
                    trials += [(kind, sh, c) for c in configs(sets[0], layer, rank)]
            for kind in ("late", "lateboth"):  # the expand alone / as the engine runs it
                if kind in kinds:
                    trials += [(kind, ex, c) for c in _late_configs(sets[0], layer, rank)]
            trials = [t for t in trials if t[0] in kinds]
            for kind, mod, cfg in trials:
                floor = FLOOR_OF.get(kind, "shrink")
                if floor == "both":
                    fns = ws_fns
                elif floor == "expand":
                    fns = [functools.partial(call_expand, st) for st in sets]
                else:
                    fns = [
                        functools.partial(call_shrink, st, v)
                        for st, v in zip(sets, views, strict=True)
                    ]
                prologue = None if floor == "expand" else memset
                us = time_config(mod, "CONFIG_OVERRIDE", cfg, fns, prologue)
                row = {"shape": shape, "kind": kind, "b_rank_major": rank_major,
                       "config": repr(cfg), "graph_us": us,
                       "floor_us": fb[floor] / bw * 1e6}  # fmt: skip
                if floor == "expand" and kind != "expand":
                    row["err_vs_default"] = config_expand_err(mod, cfg, sets[0])
                rows.append(row)
                err = f" err={row['err_vs_default']:.1e}" if "err_vs_default" in row else ""
                print(f"{shape:24s} {kind:6s} {'rm' if rank_major else 'nm'} {us:7.1f} us "
                      f"(floor {row['floor_us']:.1f}) {cfg}{err}", flush=True)  # fmt: skip
            del sets, views, pools
        torch.cuda.empty_cache()
    return rows
