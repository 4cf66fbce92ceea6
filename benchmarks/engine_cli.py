"""`benchmarks/engine_gpu.py`'s command line: its flags, and the combinations it refuses
before anything is built (`parse_args`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.engine_shapes import DEFAULT_LAYERS, SHAPES
from replica.models.moe import COMPUTE_PATHS

# --sampling: the requests' sampling fields (greedy by default, as the recorded runs)
SAMPLINGS = {
    "greedy": dict(temperature=0.0),
    "top_p": dict(temperature=0.8, top_p=0.95),
    # greedy, every row with all three penalties (the repetition one reads the prompt)
    "penalties": dict(
        temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1
    ),
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama",
                    help="llama: Llama-3-8B; mixtral: Mixtral-8x7B (8 experts, top-2)")  # fmt: skip
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers (default: llama 32, mixtral 8)")  # fmt: skip
    ap.add_argument("--moe-path", choices=COMPUTE_PATHS, default="auto",
                    help="every MoE block's SparseMoE.compute (mixtral); grouped needs --eager")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--profile", action="store_true", help="print a torch.profiler table per configuration"
    )
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs for decode steps")
    ap.add_argument(
        "--fused", action="store_true", help="one fused shrink+expand launch per LoRA layer"
    )
    ap.add_argument("--stacked", action="store_true",
                    help="the stacked layout: slots' A under each base weight (lora_stacked)")  # fmt: skip
    ap.add_argument("--only", default="", help="e.g. 128:0,128:32 (seqs:adapters) to run a subset")
    ap.add_argument(
        "--repeat", type=int, default=1, help="rounds over all combos; figures are medians"
    )
    ap.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU (checks the script runs)"
    )
    ap.add_argument("--sampling", choices=sorted(SAMPLINGS), default="greedy",
                    help="top_p: temperature 0.8, top_p 0.95; penalties: greedy with presence 0.5, "
                         "frequency 0.5, repetition 1.1 on every row")  # fmt: skip
    ap.add_argument("--structured", default="",
                    help="e.g. 64,128: also run each combo with that many rows under a JSON "
                         "grammar (128k synthetic vocabulary)")  # fmt: skip
    ap.add_argument("--breakdown", action="store_true",
                    help="print the host time of each phase of a step")  # fmt: skip
    ap.add_argument("--per-row-sampler", action="store_true",
                    help="the sampler before 2026-12-04 (a loop over rows), for comparison")  # fmt: skip
    return ap


def parse_args() -> argparse.Namespace:
    """The flags of sys.argv, `layers` defaulted per shape (DEFAULT_LAYERS). Refused (exit
    status 2, with what is allowed, but the first: 1): --per-row-sampler with --sampling
    penalties; --moe-path other than auto without --shape
    mixtral; --moe-path grouped under CUDA graphs (neither --eager nor --smoke)."""
    ap = _parser()
    args = ap.parse_args()
    if args.per_row_sampler and args.sampling == "penalties":
        raise SystemExit("--per-row-sampler has no penalties")
    if args.moe_path != "auto" and args.shape != "mixtral":
        ap.error(f"--moe-path {args.moe_path}: the {args.shape} shape has no MoE layers; "
                 "allowed with --shape mixtral")  # fmt: skip
    if args.moe_path == "grouped" and not args.eager and not args.smoke:
        ap.error("--moe-path grouped reads the per-expert token counts on the host, which a "
                 "CUDA graph cannot capture; allowed with --eager (or --smoke), else take "
                 "auto, fused or dense")  # fmt: skip
    if args.layers is None:
        args.layers = DEFAULT_LAYERS[args.shape]
    return args
