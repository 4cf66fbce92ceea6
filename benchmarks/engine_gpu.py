"""Engine decode throughput on the GPU: a random-weight Llama-3-8B-shaped model in bf16
(or with --shape mixtral a Mixtral-8x7B-shaped mixture-of-experts model).

    python benchmarks/engine_gpu.py [--out benchmarks/results/engine_gpu_h200.json]
    python benchmarks/engine_gpu.py --shape mixtral [--layers 8] [--moe-path fused] ...

Measures decode tokens/s at 32 and 128 concurrent sequences for base-only and for 8
and 32 distinct rank-16 adapters on all seven projections (a mixtral's on q/k/v/o
only: lorafleet's MoE models take LoRA on attention alone). Adapter weights are
random and written straight into the engine's GPU slots (loading is not what is
timed). The floor printed beside each figure is the base-only run at the same
concurrency, and the HBM floor of one decode step (weights + adapters + KV read
once at the copy bandwidth measured in the same run; of a mixtral's experts only those
the step's tokens reach in expectation under uniform top-2 routing, which the random
router roughly gives: `benchmarks/engine_shapes.py`).

--shape mixtral: 8 layers by default (their experts are 22.5 GB). --moe-path sets every
MoE block's `SparseMoE.compute`: auto (fused on CUDA), fused (Triton), dense (every
expert on every token, fixed shapes) or grouped (one GEMM pair per hit expert; it syncs
with the host, so only with --eager). Each result row names its shape ("llama" or
"mixtral"); a mixtral's also its expected experts touched per layer.
--smoke runs either shape at tiny sizes on the CPU, eagerly.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_shapes import (  # noqa: E402
    DEFAULT_LAYERS,
    MODEL_NAMES,
    SHAPES,
    SMOKE,
    expected_experts,
    set_moe_path,
    step_weight_bytes,
)
from lora_core.identity import AdapterRef  # noqa: E402
from replica.block_manager import BlockManager  # noqa: E402
from replica.model_runner import ModelRunner  # noqa: E402
from replica.models.config import ModelConfig  # noqa: E402
from replica.models.llama import CausalLM  # noqa: E402
from replica.models.moe import COMPUTE_PATHS  # noqa: E402
from replica.sampler import sample  # noqa: E402
from replica.sampling_params import SamplingParams  # noqa: E402
from replica.scheduler import Scheduler  # noqa: E402
from replica.sequence import Sequence  # noqa: E402
from replica.structured import Grammars, restrict  # noqa: E402
from replica.structured_spec import StructuredOutput  # noqa: E402

DEVICE = torch.device("cuda")
PROFILE = False
GRAPHS = True
# --sampling: the requests' sampling fields (greedy by default, as the recorded runs)
SAMPLINGS = {
    "greedy": dict(temperature=0.0),
    "top_p": dict(temperature=0.8, top_p=0.95),
    # greedy, every row with all three penalties (the repetition one reads the prompt)
    "penalties": dict(
        temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1
    ),
}
SAMPLING = SAMPLINGS["greedy"]
# --structured: a JSON array of strings (never ends), the grammar the constrained rows run
STRUCTURED_SCHEMA = '{"type": "array", "items": {"type": "string"}}'
GRAMMARS = None  # replica.structured.Grammars over a 128k synthetic vocabulary
BREAKDOWN = False  # --breakdown: print the host time of each phase of a step
STACKED = False  # --stacked: the slots' A under each base weight (EngineConfig.lora_stacked)


def _tokens(logits, params, generators, history=None) -> list[int]:
    return sample(logits, params, generators, None, history).tokens


SAMPLER = _tokens


class PreloadedSlots:
    """Adapter admission over slots filled once with random weights (slot = adapter index)."""

    def __init__(self, n: int):
        self.n = n

    def can_admit(self, ref: AdapterRef) -> bool:
        return True

    def acquire(self, ref: AdapterRef) -> int:
        return int(ref.name)

    def release(self, ref: AdapterRef) -> None:
        pass


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(1 << (30 if DEVICE.type == "cuda" else 26), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync()
    return 2 * src.numel() * 10 / (time.perf_counter() - t0)


def build(cfg: ModelConfig, max_loras: int, rank: int):
    from lora_core.context import LoraBatchContext, workspace_per_token
    from lora_core.layers import apply_lora
    from lora_core.slot_buffers import SlotBuffers

    with torch.device(DEVICE):
        model = CausalLM(cfg).to(torch.bfloat16)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    buffers = SlotBuffers(cfg.base_shape, max_loras, rank, torch.bfloat16, DEVICE)
    for layer in range(cfg.num_layers):
        for group in cfg.base_shape.lora_groups:  # qkv and o alone for a MoE model
            for t in buffers.a(layer, group) + buffers.b(layer, group):
                t.normal_(0, 0.02)
    buffers.slot_ranks.fill_(rank)
    ctx = LoraBatchContext(
        8192, DEVICE, buffers.slot_ranks, workspace_per_token(cfg.base_shape, rank), max_rank=rank
    )
    apply_lora(model.model, buffers, ctx, stacked=STACKED)
    return model, ctx, buffers


def run(
    model, ctx, cfg, num_seqs: int, num_adapters: int, prompt_len: int, steps: int,
    structured: int = 0,
) -> dict:  # fmt: skip
    bs = 16
    blocks = -(-(prompt_len + steps + 8) // bs) * num_seqs + 8
    shape = (blocks + 1, bs, cfg.num_kv_heads, cfg.head_dim)  # + the CUDA-graph scratch block
    kv = [
        (
            torch.empty(shape, dtype=torch.bfloat16, device=DEVICE),
            torch.empty(shape, dtype=torch.bfloat16, device=DEVICE),
        )
        for _ in range(cfg.num_layers)
    ]
    graphs = None
    if GRAPHS:
        from replica.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(
            model, kv, bs, ctx, blocks, num_seqs, -(-(prompt_len + steps + 8) // bs)
        )
    runner = ModelRunner(model, kv, bs, ctx, graphs)
    sched = Scheduler(BlockManager(blocks, bs, False), PreloadedSlots(num_adapters), num_seqs, 8192)
    params = SamplingParams(max_tokens=10**6, ignore_eos=True, **SAMPLING)
    g = torch.Generator().manual_seed(0)
    for i in range(num_seqs):
        ref = AdapterRef(str(i % num_adapters), 1, "0" * 64, "", 16) if num_adapters else None
        prompt = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=g).tolist()
        seq = Sequence(str(i), prompt_len, prompt, params, ref, i)
        if i < structured:
            seq.matcher = GRAMMARS.matcher(StructuredOutput("json", STRUCTURED_SCHEMA))
        sched.add(seq)

    phases: dict[str, float] = {}
    clock = [time.perf_counter()]

    def lap(name: str) -> None:  # host time of each phase of a step (--breakdown)
        now = time.perf_counter()
        phases[name] = phases.get(name, 0.0) + now - clock[0]
        clock[0] = now

    def step():  # LLMEngine.step's work, structured outputs included
        lap("between steps")
        out = sched.schedule()
        batch = runner.prepare(out.scheduled)
        seqs = batch.sample_seqs
        guided = [i for i, s in enumerate(seqs) if s.matcher is not None]
        lap("schedule + prepare")
        logits = runner.execute(batch).logits
        sched.after_step(out)
        lap("execute (launch)")
        if guided:
            allowed = GRAMMARS.allowed([seqs[i].matcher for i in guided], logits.device)
            logits = restrict(logits, guided, allowed)
            lap("fill + mask launch")
        toks = SAMPLER(logits, [s.params for s in seqs], [None] * len(seqs), history=seqs)
        lap("sample (syncs)")
        for s, t in zip(seqs, toks, strict=True):
            s.tokens.append(t)
        if guided:
            matchers = [seqs[i].matcher for i in guided]
            accepted = GRAMMARS.accept(matchers, [toks[i] for i in guided])
            for m, ok in zip(matchers, accepted, strict=True):
                if not ok or m.is_terminated():
                    m.reset()  # the array closed (EOS taken): start another
            lap("grammar accept")
        return out

    step()  # prefill of every sequence (the token budget covers all prompts)
    for _ in range(3):
        step()
    if PROFILE:
        from torch.profiler import ProfilerActivity, profile

        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            sync()
        print(f"--- profile: {num_seqs} seqs, {num_adapters} adapters (3 steps)")
        print(
            prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=14, max_name_column_width=60
            )
        )
        print(
            prof.key_averages().table(
                sort_by="cpu_time_total", row_limit=8, max_name_column_width=60
            )
        )
    sync()
    t0 = time.perf_counter()
    phases.clear()
    clock[0] = t0
    for _ in range(steps):
        step()
    sync()
    dt = time.perf_counter() - t0
    if BREAKDOWN:
        print(f"{num_seqs} seqs, {structured} structured: host ms per step",
              {k: round(v / steps * 1e3, 3) for k, v in phases.items()}, flush=True)  # fmt: skip
    replays = graphs.replays if graphs else 0
    del kv, graphs
    return {
        "decode_tokens_per_s": num_seqs * steps / dt,
        "step_ms": dt / steps * 1e3,
        "graph_replays": replays,
    }


def main() -> None:
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
    args = ap.parse_args()
    global SAMPLING, SAMPLER
    SAMPLING = SAMPLINGS[args.sampling]
    if args.per_row_sampler:
        from sampler_gpu import per_row_baseline

        if args.sampling == "penalties":
            raise SystemExit("--per-row-sampler has no penalties")

        def SAMPLER(logits, params, generators, history=None):  # noqa: N802 (the global's name)
            return per_row_baseline(logits, params, generators)

    if args.fused:
        from kernels.triton import lora_fused

        lora_fused.FUSED_MAX_TOKENS = 1 << 30
    global DEVICE, PROFILE, GRAPHS, GRAMMARS, BREAKDOWN, STACKED
    BREAKDOWN = args.breakdown
    STACKED = args.stacked
    structured = [0] + [int(k) for k in args.structured.split(",") if k]
    PROFILE = args.profile
    GRAPHS = not args.eager and not args.smoke
    if args.moe_path != "auto" and args.shape != "mixtral":
        ap.error(f"--moe-path {args.moe_path}: the {args.shape} shape has no MoE layers; "
                 "allowed with --shape mixtral")  # fmt: skip
    if args.moe_path == "grouped" and GRAPHS:
        ap.error("--moe-path grouped reads the per-expert token counts on the host, which a "
                 "CUDA graph cannot capture; allowed with --eager (or --smoke), else take "
                 "auto, fused or dense")  # fmt: skip
    if args.layers is None:
        args.layers = DEFAULT_LAYERS[args.shape]
    hf = {**SHAPES[args.shape], "num_hidden_layers": args.layers}
    if args.smoke:
        DEVICE = torch.device("cpu")
        hf.update(SMOKE)
    cfg = ModelConfig.from_hf(hf)
    if args.structured:
        from synthetic_vocab import synthetic_tokenizer

        tok = synthetic_tokenizer(min(128000, cfg.vocab_size))
        GRAMMARS = Grammars(tok, cfg.vocab_size, [tok.eos_token_id])
    bw = copy_bandwidth()
    model, ctx, buffers = build(cfg, 32, args.rank)
    set_moe_path(model, args.moe_path)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    per_adapter = buffers.nbytes / 32
    rows = []
    combos = [(s, n) for s in (32, 128) for n in (0, 8, 32)]
    if args.only:
        combos = [tuple(int(v) for v in c.split(":")) for c in args.only.split(",")]
    runs = []
    for rnd in range(args.repeat):  # rounds over all combos: drift hits every combo alike
        for (seqs, n), k in itertools.product(combos, structured):
            r = run(model, ctx, cfg, seqs, n, args.prompt_len, args.steps, min(k, seqs))
            r.update(num_seqs=seqs, distinct_adapters=n, structured_rows=min(k, seqs), round=rnd)
            runs.append(r)
            print(json.dumps(r), flush=True)
    for (seqs, n), k in itertools.product(combos, structured):
        key = (seqs, n, min(k, seqs))
        mine = [
            r for r in runs if (r["num_seqs"], r["distinct_adapters"], r["structured_rows"]) == key
        ]
        ctx_tokens = seqs * (args.prompt_len + args.steps)
        kv_bytes = ctx_tokens * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
        floor_s = (step_weight_bytes(model, seqs) + n * per_adapter + kv_bytes) / bw
        step_ms = statistics.median(r["step_ms"] for r in mine)
        rows.append({
            "decode_tokens_per_s": seqs / step_ms * 1e3, "step_ms": step_ms,
            "step_ms_per_round": [round(r["step_ms"], 3) for r in mine],
            "graph_replays": mine[0]["graph_replays"], "num_seqs": seqs,
            "distinct_adapters": n, "structured_rows": key[2], "hbm_floor_step_ms": floor_s * 1e3,
            "shape": args.shape,
        })  # fmt: skip
        if cfg.num_experts:
            rows[-1]["expected_experts_per_layer"] = expected_experts(
                cfg.num_experts, cfg.num_experts_per_tok, seqs
            )
    base = {
        r["num_seqs"]: r["decode_tokens_per_s"]
        for r in rows
        if r["distinct_adapters"] == 0 and r["structured_rows"] == 0
    }
    for r in rows:
        base.setdefault(r["num_seqs"], r["decode_tokens_per_s"])
    print(
        f"\ncopy bandwidth {bw / 1e12:.2f} TB/s; weights {weight_bytes / 1e9:.1f} GB; adapter {per_adapter / 1e6:.1f} MB"
    )
    if cfg.num_experts:
        print(f"{cfg.num_experts} experts top-{cfg.num_experts_per_tok} per layer, moe path "
              f"{args.moe_path}; HBM floor: the experts a step touches in expectation "
              "(expected_experts_per_layer) + the other weights, adapters and KV")  # fmt: skip
    print(
        f"{'seqs':>5} {'adapters':>8} {'grammar':>7} {'tok/s':>9} {'step ms':>8} {'HBM floor ms':>12} {'vs base':>8}"
    )
    for r in rows:
        r["ratio_to_base"] = r["decode_tokens_per_s"] / base[r["num_seqs"]]
        print(
            f"{r['num_seqs']:>5} {r['distinct_adapters']:>8} {r['structured_rows']:>7} {r['decode_tokens_per_s']:>9.0f} {r['step_ms']:>8.2f} {r['hbm_floor_step_ms']:>12.2f} {r['ratio_to_base']:>7.2f}x"
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "command": "python " + " ".join(sys.argv),
                    "device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu",
                    "torch": torch.__version__,
                    "copy_bandwidth_Bps": bw,
                    "model": MODEL_NAMES[args.shape],
                    **({"moe_path": args.moe_path} if cfg.num_experts else {}),
                    "layers": args.layers,
                    "rank": args.rank,
                    "prompt_len": args.prompt_len,
                    "steps": args.steps,
                    "rounds": args.repeat,
                    "cuda_graphs": GRAPHS,
                    "sampling": {**SAMPLING, "sampler": SAMPLER.__name__},
                    "structured": {
                        "schema": STRUCTURED_SCHEMA,
                        "vocabulary": "synthetic 128k",
                        "fill": "on the host after the forward is launched",
                    },
                    "results": rows,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
