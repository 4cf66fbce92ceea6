"""Inputs and timing shared by the LoRA kernel benchmarks (lora_kernels.py, lora_tune.py,
kernel_once.py): Llama-3-8B layer shapes, adapter pools laid out as the engine's slots,
rotated input sets, CUDA-graph timing and the byte floor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import (  # noqa: E402
    SegmentMeta,
    build_meta,
    lora_expand,
    lora_shrink,
    lora_shrink_expand,
)
from kernels.testing import random_slots  # noqa: E402
from kernels.triton.lora_fused import lora_shrink_expand_triton  # noqa: E402

LAYERS = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
POOL_SLOTS = 64
MAX_SETS = 48
DT = torch.bfloat16
EL = 2
ROTATE_BYTES = 3 * 60e6  # three L2s per replay


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy, read + written."""
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=20, rep=100, return_mode="median")
    return 2 * a.numel() / (ms * 1e-3)


def probe_header() -> tuple[float, dict]:
    """Copy bandwidth (measured and printed) and the fields every probe's results file
    starts with: (bytes/s, {command, device, torch, triton, copy_bw_TBps})."""
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    return bw, {
        "command": "python3 " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_bw_TBps": bw / 1e12,
    }


def floor_bytes(layer: str, tokens: int, n: int, mean_rank: float, rank: int) -> dict[str, float]:
    hidden, sizes = LAYERS[layer]
    s, total_n = len(sizes), sum(sizes)
    terms = {
        "x": tokens * hidden * EL,
        "A": n * s * mean_rank * hidden * EL,
        "B": n * total_n * mean_rank * EL,
        "y": 2 * tokens * total_n * EL,
        "buf": s * tokens * rank * 4,
    }
    return {
        "terms": terms,
        "shrink": terms["x"] + terms["A"] + terms["buf"],
        "expand": terms["B"] + terms["y"] + terms["buf"],
        "both": sum(terms.values()) - terms["buf"],
    }


def num_sets(floor: dict[str, float]) -> int:
    """Input sets to rotate so one graph replay moves ROTATE_BYTES (L2 holds none of the
    next call's bytes); floor: floor_bytes(...)."""
    return max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / floor["both"])))


class Pool:
    """One layer's adapter weights for POOL_SLOTS slots at max rank `rank`, laid out as the
    engine's slots are: A_s [L, R, H]; B_s [L, N_s, R] stored rank-major ([L, R, N_s]),
    or n-major with rank_major=False (the layout before, for --tune's comparison)."""

    def __init__(self, layer: str, rank: int, rank_major: bool = True):
        hidden, sizes = LAYERS[layer]
        self.a = tuple(
            (torch.randn(POOL_SLOTS, rank, hidden, device="cuda") * hidden**-0.5).to(DT)
            for _ in sizes
        )
        if rank_major:
            self.b = tuple(
                (torch.randn(POOL_SLOTS, rank, n, device="cuda") * rank**-0.5)
                .to(DT)
                .transpose(1, 2)
                for n in sizes
            )
        else:
            self.b = tuple(
                (torch.randn(POOL_SLOTS, n, rank, device="cuda") * rank**-0.5).to(DT) for n in sizes
            )


class Pools:
    """Copies of one layer's pool, made as needed: rotating them keeps each call's weights out of L2."""

    def __init__(self, layer: str, rank: int, rank_major: bool = True):
        self.layer, self.rank, self.rank_major, self.pools = layer, rank, rank_major, []

    def get(self, count: int) -> list[Pool]:
        while len(self.pools) < count:
            self.pools.append(Pool(self.layer, self.rank, self.rank_major))
        return self.pools[:count]


def make_sets(layer, pools, tokens, n, nsets, ranks_of, block_m=None, expected_slots=None):
    """One slot map and SegmentMeta (built once per step, as the engine does, so L2-warm;
    block_m None: the default for T; expected_slots: SegmentMeta.expected_slots); nsets
    copies of weights, x and y, rotated between calls."""
    hidden, sizes = LAYERS[layer]
    rank = pools.rank
    chosen = torch.randperm(POOL_SLOTS)[:n]
    ranks = torch.full((POOL_SLOTS,), rank, dtype=torch.int32)
    for i, slot in enumerate(chosen.tolist()):
        ranks[slot] = ranks_of(i)
    slots = chosen[random_slots(tokens, n, n, 0.0)].cuda()
    ranks = ranks.cuda()
    empty = SegmentMeta.empty(
        tokens, POOL_SLOTS, slots.device, block_m, max_rank=rank, expected_slots=expected_slots
    )
    meta = build_meta(slots, POOL_SLOTS, slot_ranks=ranks, out=empty)
    sets = []
    for pool in pools.get(nsets):
        x = torch.randn(tokens, hidden, device="cuda").to(DT)
        y = torch.randn(tokens, sum(sizes), device="cuda").to(DT)
        st = {"pool": pool, "slots": slots, "meta": meta, "x": x, "y": y}
        st["buf"] = lora_shrink(x, pool.a, meta)
        sets.append(st)
    return sets, ranks


@contextlib.contextmanager
def expecting(sets, expected_slots: int | None):
    """Every set's SegmentMeta with expected_slots (the same buffers) inside the block;
    the sets' own meta again after it."""
    meta = sets[0]["meta"]
    for st in sets:
        st["meta"] = dataclasses.replace(meta, expected_slots=expected_slots)
    try:
        yield
    finally:
        for st in sets:
            st["meta"] = meta


def time_graph(fns, rep_ms: int = 25, prologue=None) -> float:
    """Median us of one call under CUDA-graph replay: one graph runs prologue (if any: the
    step's one workspace memset) and then fns (rotated sets) in turn."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in [prologue] * (prologue is not None) + list(fns):
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in [prologue] * (prologue is not None) + list(fns):
            f()
    replay = do_bench(graph.replay, warmup=3, rep=rep_ms, return_mode="median") * 1e3
    del graph
    return replay / len(fns)


def time_both_modes(fns, nsets, graph_fns=None, prologue=None) -> dict[str, float]:
    """{eager_us, graph_us} medians for one call; fns[k] runs the call on set k
    (graph_fns[k] under graph replay, after prologue, when given)."""
    counter = [0]

    def cycle():
        fns[counter[0] % nsets]()
        counter[0] += 1

    eager = do_bench(cycle, warmup=3, rep=15, return_mode="median") * 1e3
    return {"eager_us": eager, "graph_us": time_graph(graph_fns or fns, prologue=prologue)}


def workspaces(sets, layer: str, rank: int):
    """(memset, one zeroed float32 [S, T, R] shrink output per set): the engine's per-step
    workspace (lora_core.context.LoraBatchContext), one memset for every call of the step."""
    tokens, slices = sets[0]["x"].shape[0], len(LAYERS[layer][1])
    size = slices * tokens * rank
    ws = torch.zeros(len(sets) * size, dtype=torch.float32, device="cuda")
    views = [ws[k * size : (k + 1) * size].view(slices, tokens, rank) for k in range(len(sets))]
    return ws.zero_, views


@contextlib.contextmanager
def pdl(enabled: bool):
    """Programmatic dependent launch on or off (LORAFLEET_PDL) inside the block."""
    before = os.environ.get("LORAFLEET_PDL")
    os.environ["LORAFLEET_PDL"] = "1" if enabled else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["LORAFLEET_PDL"]
        else:
            os.environ["LORAFLEET_PDL"] = before


def call_shrink(st, out=None):
    lora_shrink(st["x"], st["pool"].a, st["meta"], out=out)


def call_expand(st):
    lora_expand(st["y"], st["buf"], st["pool"].b, st["meta"])


def expand_err(st, run) -> float:
    """Max |y - y_default| / max |y_default| after run() (an expand variant on set st)
    against kernels.lora_expand's default config, both from the same y (restored
    afterwards)."""
    y0 = st["y"].clone()
    call_expand(st)
    want = st["y"].float()
    st["y"].copy_(y0)
    run()
    err = ((st["y"].float() - want).abs().max() / want.abs().max()).item()
    st["y"].copy_(y0)
    return err


def call_both(st, workspace=None):
    lora_shrink_expand(
        st["y"], st["x"], st["pool"].a, st["pool"].b, st["meta"], workspace=workspace
    )


def call_fused(st):
    lora_shrink_expand_triton(st["y"], st["x"], st["pool"].a, st["pool"].b, st["meta"])


def time_config(mod, name: str, cfg, fns, prologue=None) -> float:
    """Graph-replay us of fns with mod.<name> (a launch-config override) set to cfg; NaN,
    printed, if the config cannot launch (an unlaunchable config is data too). The
    override is reset to None afterwards."""
    setattr(mod, name, cfg)
    try:
        return time_graph(fns, 10, prologue=prologue)
    except Exception as e:
        print(f"  {cfg}: {e!r}"[:300], flush=True)
        return float("nan")
    finally:
        setattr(mod, name, None)


def config_expand_err(mod, cfg, st: dict) -> float:
    """lora_bench.expand_err of one expand call with launch config cfg."""

    def run():
        mod.CONFIG_OVERRIDE = cfg
        try:
            call_expand(st)
        finally:
            mod.CONFIG_OVERRIDE = None

    return expand_err(st, run)


def config_shrink_err(mod, cfg, st: dict) -> float:
    """Max |out - out_default| / max |out_default| of one shrink call with launch config
    cfg against the default config's, on set st."""
    want = lora_shrink(st["x"], st["pool"].a, st["meta"])
    mod.CONFIG_OVERRIDE = cfg
    try:
        got = lora_shrink(st["x"], st["pool"].a, st["meta"])
    finally:
        mod.CONFIG_OVERRIDE = None
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def default_shrink(st: dict, layer: str, rank: int):
    from kernels.triton.common import block_r
    from kernels.triton.shrink_plan import default_config

    hidden, sizes = LAYERS[layer]
    x = st["x"]
    meta = st["meta"]
    return default_config(
        meta.block_m, block_r(rank), x.element_size(), len(sizes), hidden, x.shape[0],
        meta.expected_slots,
    )  # fmt: skip
