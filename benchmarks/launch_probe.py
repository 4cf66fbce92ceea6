"""Probe (GPU): host time of one eager LoRA layer call, and where it goes.

    python3 benchmarks/launch_probe.py --out benchmarks/results/launch_probe_h100.json

A step that is not replayed from a CUDA graph (a prefill or mixed step, `--eager`, every
step under tensor parallelism) pays each LoRA layer's host time: 224 calls per step of
a 32-layer model. This times, per call, on one-token shapes (the GPU finishes each
kernel in a few microseconds, so the host is what is measured): `lora_shrink_expand`
as a layer calls it (with the launchers' kept binaries, kernels/triton/launch.py, and
through Triton's dispatch); the shrink and the expand alone; the same with the launches
replaced by no-ops (the launchers' own Python); an empty Triton kernel with as many
arguments launched through `kernel[grid](...)`; and torch's `add_` as the floor of a
launch from Python. Then a cProfile of the layer call's top functions.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402
import kernels.triton.launch as launch  # noqa: E402
import kernels.triton.lora_expand as lora_expand_mod  # noqa: E402
import kernels.triton.lora_shrink as lora_shrink_mod  # noqa: E402
from benchmarks.lora_bench import LAYERS, Pools, make_sets, workspaces  # noqa: E402


@triton.jit
def _empty(
    a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18,
    a19, a20, a21, a22, a23, a24, a25, a26,
    C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr,
):  # fmt: skip
    pass


def per_call_us(fn, calls: int) -> float:
    """Host microseconds per call of fn, the GPU drained before and after."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer", default="qkv", choices=list(LAYERS))
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    st = make_sets(args.layer, Pools(args.layer, 16), args.tokens, 1, 1, lambda i: 16)[0][0]
    _, views = workspaces([st], args.layer, 16)
    ws = views[0]
    pool = st["pool"]

    def both():
        kernels.lora_shrink_expand(st["y"], st["x"], pool.a, pool.b, st["meta"], workspace=ws)

    def shrink():
        kernels.lora_shrink(st["x"], pool.a, st["meta"], out=ws)

    def expand():
        kernels.lora_expand(st["y"], ws, pool.b, st["meta"])

    ptrs = [st["x"]] * 3
    ints = list(range(3, 27))

    def empty():
        _empty[(1, 1, 1)](*ptrs, *ints, C0=1, C1=2, C2=3, C3=4)

    y = st["y"]
    rows = {
        "both": per_call_us(both, args.calls),
        "shrink": per_call_us(shrink, args.calls),
        "expand": per_call_us(expand, args.calls),
        "empty_triton_27_args": per_call_us(empty, args.calls),
        "torch_add_": per_call_us(lambda: y.add_(1), args.calls),
    }
    fast = launch.ENABLED
    launch.ENABLED = False
    rows["both_through_triton_dispatch"] = per_call_us(both, args.calls)
    launch.ENABLED = fast
    rows["kept_binaries_on"] = fast
    saved = (lora_shrink_mod._SHRINK, lora_expand_mod._EXPAND)
    lora_shrink_mod._SHRINK = lora_expand_mod._EXPAND = lambda *args, **kwargs: None
    try:
        rows["both_launchers_python_only"] = per_call_us(both, args.calls)
    finally:
        lora_shrink_mod._SHRINK, lora_expand_mod._EXPAND = saved
    for k, v in rows.items():
        print(f"{k:30} {v:8.2f} us per call" if isinstance(v, float) else f"{k:30} {v}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        both()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    print(text.getvalue())
    if args.out:
        doc = {
            "command": "python3 " + " ".join(sys.argv),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "layer": args.layer,
            "tokens": args.tokens,
            "host_us_per_call": rows,
            "profile_top": text.getvalue().splitlines()[:45],
        }
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
