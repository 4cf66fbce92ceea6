"""What `benchmarks/engine_gpu.py` reports: each combination's median step over the
rounds beside the HBM floor of one decode step (`StepFloor`), the table it prints, and
the document `--out` writes.

A combination is (seqs, adapters, structured rows); a run is one round of one
combination: {decode_tokens_per_s, step_ms, graph_replays, num_seqs, distinct_adapters,
structured_rows, round}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass

import torch
from torch import nn

from benchmarks.engine_shapes import MODEL_NAMES, expected_experts, step_weight_bytes
from replica.models.config import ModelConfig


@dataclass(frozen=True)
class StepFloor:
    """The HBM floor of one decode step: the bytes it must read, once each, at the copy
    bandwidth measured in the same run. Those are the weights the step reaches
    (`step_weight_bytes`: of a MoE layer's experts only those its tokens reach in
    expectation), each distinct adapter's A and B, and the KV cache (K and V, bf16) of
    every sequence at its longest."""

    model: nn.Module
    cfg: ModelConfig
    adapter_bytes: float
    """One adapter's A and B over all layers, in bytes."""
    bandwidth: float
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    context_len: int
    """Tokens a sequence holds in the KV cache by the timed steps' end (prompt + steps)."""

    def step_ms(self, seqs: int, adapters: int) -> float:
        """The floor in ms of a step of `seqs` sequences over `adapters` distinct adapters."""
        cfg = self.cfg
        ctx_tokens = seqs * self.context_len
        kv_bytes = ctx_tokens * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
        nbytes = step_weight_bytes(self.model, seqs) + adapters * self.adapter_bytes + kv_bytes
        return nbytes / self.bandwidth * 1e3


def summarize(
    runs: list[dict], combos: list[tuple[int, int, int]], floor: StepFloor, shape: str
) -> list[dict]:
    """One row per combination (seqs, adapters, structured rows), in `combos`' order: the
    median step over its rounds, the floor, and `ratio_to_base`, its tok/s over that of
    the base-only unconstrained row with as many sequences (None without one: a row is
    no baseline of itself). A MoE model's rows also give `expected_experts_per_layer`."""
    rows = []
    for key in combos:
        seqs, n, k = key
        mine = [
            r for r in runs if (r["num_seqs"], r["distinct_adapters"], r["structured_rows"]) == key
        ]
        step_ms = statistics.median(r["step_ms"] for r in mine)
        rows.append({
            "decode_tokens_per_s": seqs / step_ms * 1e3, "step_ms": step_ms,
            "step_ms_per_round": [round(r["step_ms"], 3) for r in mine],
            "graph_replays": mine[0]["graph_replays"], "num_seqs": seqs,
            "distinct_adapters": n, "structured_rows": k,
            "hbm_floor_step_ms": floor.step_ms(seqs, n), "shape": shape,
        })  # fmt: skip
        if floor.cfg.num_experts:
            rows[-1]["expected_experts_per_layer"] = expected_experts(
                floor.cfg.num_experts, floor.cfg.num_experts_per_tok, seqs
            )
    base = {
        r["num_seqs"]: r["decode_tokens_per_s"]
        for r in rows
        if r["distinct_adapters"] == 0 and r["structured_rows"] == 0
    }
    for r in rows:
        own = base.get(r["num_seqs"])
        r["ratio_to_base"] = None if own is None else r["decode_tokens_per_s"] / own
    return rows


def print_table(rows: list[dict], floor: StepFloor, moe_path: str) -> None:
    """The bandwidth and sizes the floor stands on, then one line per row."""
    weight_bytes = sum(p.numel() * p.element_size() for p in floor.model.parameters())
    print(
        f"\ncopy bandwidth {floor.bandwidth / 1e12:.2f} TB/s; weights {weight_bytes / 1e9:.1f} GB; adapter {floor.adapter_bytes / 1e6:.1f} MB"
    )
    cfg = floor.cfg
    if cfg.num_experts:
        print(f"{cfg.num_experts} experts top-{cfg.num_experts_per_tok} per layer, moe path "
              f"{moe_path}; HBM floor: the experts a step touches in expectation "
              "(expected_experts_per_layer) + the other weights, adapters and KV")  # fmt: skip
    print(
        f"{'seqs':>5} {'adapters':>8} {'grammar':>7} {'tok/s':>9} {'step ms':>8} {'HBM floor ms':>12} {'vs base':>8}"
    )
    for r in rows:
        ratio = "-" if r["ratio_to_base"] is None else f"{r['ratio_to_base']:.2f}x"
        print(
            f"{r['num_seqs']:>5} {r['distinct_adapters']:>8} {r['structured_rows']:>7} {r['decode_tokens_per_s']:>9.0f} {r['step_ms']:>8.2f} {r['hbm_floor_step_ms']:>12.2f} {ratio:>8}"
        )


def result_doc(
    args: argparse.Namespace, device: torch.device, floor: StepFloor, graphs: bool,
    sampling: dict, schema: str, rows: list[dict],
) -> dict:  # fmt: skip
    """The document `--out` writes: the command, device and run settings, then the rows.
    `sampling`: the requests' sampling fields and the sampler's name; `schema`: the JSON
    schema of the structured rows."""
    return {
        "command": "python " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "copy_bandwidth_Bps": floor.bandwidth,
        "model": MODEL_NAMES[args.shape],
        **({"moe_path": args.moe_path} if floor.cfg.num_experts else {}),
        "layers": args.layers,
        "rank": args.rank,
        "prompt_len": args.prompt_len,
        "steps": args.steps,
        "rounds": args.repeat,
        "cuda_graphs": graphs,
        "sampling": sampling,
        "structured": {
            "schema": schema,
            "vocabulary": "synthetic 128k",
            "fill": "on the host after the forward is launched",
        },
        "results": rows,
    }
