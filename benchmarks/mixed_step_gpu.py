"""Prefill and mixed steps on the GPU: eager against piecewise CUDA graphs
(`replica.mixed_graphs`), base-only and with 32 distinct rank-16 adapters on all seven
projections, on a random-weight Llama-3-8B-shaped model in bf16.

    python3 benchmarks/mixed_step_gpu.py [--out benchmarks/results/mixed_step_h100.json]
    python3 benchmarks/mixed_step_gpu.py --smoke      # tiny shapes on the CPU, no capture

A step holds D decode tokens (sequences at context --context) and one prompt chunk of P
tokens, as a continuously batching engine's steps do while requests arrive; decode-only
steps replay whole-step graphs (`replica.cuda_graphs`) and are not timed here. Each row
times `ModelRunner.execute` (the forward and the sample rows' logits) with a sync after
every step, as the engine's sampling syncs; the median of --steps after --warmup steps.
Beside each figure it prints its floor: the eager base-only step of the same shape (what
LoRA and graphs are measured against). Each graphs row also gives the first step's time
(its capture), the memory the capture took, and the largest |logit| difference from the
eager step (the same kernels over padded rows: bf16 rounding only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import engine_gpu  # noqa: E402
from benchmarks.engine_shapes import LLAMA3_8B, SMOKE  # noqa: E402
from replica.config import DENSE_PROMPT_MIN  # noqa: E402
from replica.layers.attention import AttentionMetadata, PrefillChunk  # noqa: E402
from replica.mixed_graphs import MixedGraphs  # noqa: E402
from replica.model_runner import ModelRunner, StepBatch  # noqa: E402
from replica.models.config import ModelConfig  # noqa: E402

SHAPES = [(16, 48), (128, 128), (128, 512), (0, 1024), (64, 1984)]
"""(decode tokens D, prompt-chunk tokens P) of the steps timed."""
BLOCK = 16


def make_batch(
    cfg: ModelConfig, d: int, p: int, context: int, adapters: int, device,
    dense_prompt_min: int = DENSE_PROMPT_MIN,
) -> StepBatch:  # fmt: skip
    """D decode sequences at `context` tokens (KV blocks 0..) and one new prompt's first P
    tokens (blocks after theirs); decode token i takes adapter i % adapters, the chunk 0.
    dense_prompt_min: the engine's EngineConfig.dense_prompt_min."""
    per_seq = _blocks(context + 1)
    tables = torch.arange(d * per_seq).view(d, per_seq)
    chunk_table = torch.arange(_blocks(p)) + d * per_seq
    decode_slots = tables[:, context // BLOCK] * BLOCK + context % BLOCK
    slots = torch.cat([decode_slots, chunk_table.repeat_interleave(BLOCK)[:p] * BLOCK
                       + torch.arange(p) % BLOCK])  # fmt: skip
    lora = [i % adapters if adapters else -1 for i in range(d)] + [0 if adapters else -1] * p
    g = torch.Generator().manual_seed(d * 7919 + p)
    on = dict(device=device)
    meta = AttentionMetadata(
        slot_mapping=slots.to(**on),
        num_decode=d,
        decode_block_tables=tables.to(**on) if d else None,
        decode_context_lens=torch.full((d,), context + 1, **on) if d else None,
        prefills=[PrefillChunk(d, p, p, chunk_table.to(**on))] if p else [],
        dense_prompt_min=dense_prompt_min,
    )
    rows = list(range(d)) + ([d + p - 1] if p else [])
    return StepBatch(
        input_ids=torch.randint(0, cfg.vocab_size, (d + p,), generator=g).to(**on),
        positions=torch.cat([torch.full((d,), context), torch.arange(p)]).to(**on),
        lora_slots=torch.tensor(lora, **on),
        lora_count=len({s for s in lora if s >= 0}),
        meta=meta,
        sample_rows=torch.tensor(rows, **on),
        sample_seqs=[],
    )


def _blocks(tokens: int) -> int:
    """KV blocks that hold `tokens` tokens."""
    return -(-tokens // BLOCK)


def blocks_needed(d: int, p: int, context: int) -> int:
    """KV blocks `make_batch(d, p, context)` uses."""
    return d * _blocks(context + 1) + _blocks(p)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(runner, batch, steps: int, warmup: int, device) -> tuple[float, float, torch.Tensor]:
    """-> (first step ms, median step ms after warmup, the last step's logits)."""
    times = []
    for _ in range(warmup + steps + 1):
        batch.meta.step_cache.clear()  # each engine step makes its masks and tiles afresh
        t0 = time.perf_counter()
        logits = runner.execute(batch).logits
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times[0], statistics.median(times[1 + warmup :]), logits


def run(args) -> dict:
    device = torch.device("cpu" if args.smoke else "cuda")
    engine_gpu.DEVICE, engine_gpu.STACKED = device, False
    hf = {**LLAMA3_8B, "num_hidden_layers": args.layers}
    if args.smoke:
        hf.update(SMOKE)
    cfg = ModelConfig.from_hf(hf)
    model, ctx, _ = engine_gpu.build(cfg, 32, 16)
    need = max(blocks_needed(d, p, args.context) for d, p in args.shapes) + 1
    shape = (need, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    kv = [(torch.zeros(shape, dtype=torch.bfloat16, device=device),
           torch.zeros(shape, dtype=torch.bfloat16, device=device))
          for _ in range(cfg.num_layers)]  # fmt: skip
    mixed = MixedGraphs(model, kv, ctx, 2048, capture=device.type == "cuda")
    eager = ModelRunner(model, kv, BLOCK, ctx)
    graphs = ModelRunner(model, kv, BLOCK, ctx, mixed=mixed)
    rows = []
    for d, p in args.shapes:
        base_ms = None
        for adapters in (0, 32):
            batch = make_batch(cfg, d, p, args.context, adapters, device, args.dense_prompt_min)
            _, eager_ms, want = time_steps(eager, batch, args.steps, args.warmup, device)
            base_ms = base_ms or eager_ms
            row = {
                "decode_tokens": d, "prompt_chunk_tokens": p, "tokens": d + p,
                "distinct_adapters": batch.lora_count, "eager_ms": round(eager_ms, 3),
                "floor_eager_base_ms": round(base_ms, 3),
                "eager_vs_floor": round(eager_ms / base_ms, 3),
            }  # fmt: skip
            rows.append(row)
            head = f"D {d:4d} + P {p:4d}  adapters {adapters:2d}:  eager {eager_ms:7.2f} ms"
            floor = f"floor (eager base-only) {base_ms:7.2f} ms: eager x{eager_ms / base_ms:.2f}"
            bucket = mixed.key_for(d + p, batch.lora_count)
            if bucket is None:  # past the graphs' buckets: the engine runs it eagerly too
                print(f"{head} (no graph bucket this large)  |  {floor}", flush=True)
                continue
            if device.type == "cuda":  # a capture empties the allocator's cache first
                torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved() if device.type == "cuda" else 0
            replays = mixed.replays
            first_ms, graph_ms, got = time_steps(graphs, batch, args.steps, args.warmup, device)
            taken = (torch.cuda.memory_reserved() - before) / 2**20 if device.type == "cuda" else 0
            assert mixed.replays > replays, "the graphs runner ran eagerly (capture failed?)"
            row.update({
                "token_bucket": bucket[0], "graphs_ms": round(graph_ms, 3),
                "graphs_speedup": round(eager_ms / graph_ms, 3),
                "graphs_vs_floor": round(graph_ms / base_ms, 3),
                "first_graphs_step_ms": round(first_ms, 1),
                "capture_memory_mib": round(taken, 1),
                "logits_max_abs_diff": float((got - want).abs().max()),
            })  # fmt: skip
            print(
                f"{head}  graphs {graph_ms:7.2f} ms ({eager_ms / graph_ms:.2f}x)  |  {floor}, "
                f"graphs x{graph_ms / base_ms:.2f}  |  first step {first_ms:.0f} ms, "
                f"+{taken:.0f} MiB, max |dlogit| {row['logits_max_abs_diff']:.3g}",
                flush=True,
            )
    return {
        "command": "python3 " + " ".join(sys.argv),
        "dense_prompt_min": args.dense_prompt_min,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": f"Llama-3-8B-shaped, {args.layers} layers, bf16, random weights",
        "adapters": "rank 16 on all seven projections, 32 slots",
        "context": args.context,
        "steps": args.steps,
        "rows": rows,
    }


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=512, help="decode sequences' KV length")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--shapes", default=",".join(f"{d}+{p}" for d, p in SHAPES),
                    help="D+P,... decode tokens + prompt-chunk tokens per step")  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, no capture")
    ap.add_argument("--dense-prompt-min", type=int, default=DENSE_PROMPT_MIN,
                    help="whole prompts of this many tokens attend through dense SDPA "
                    "(EngineConfig.dense_prompt_min; 0: all paged)")  # fmt: skip
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    try:
        args.shapes = [tuple(int(v) for v in s.split("+")) for s in args.shapes.split(",")]
    except ValueError:
        ap.error(f"--shapes {args.shapes!r}: expected D+P,... (integers)")
    if any(len(s) != 2 or min(s) < 0 or sum(s) < 1 for s in args.shapes):
        ap.error(f"--shapes {args.shapes}: each D+P needs D, P >= 0 and D + P >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    doc = run(args)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
