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
router roughly gives: `benchmarks/engine_shapes.py`). The rows, the table and the --out
document: `benchmarks/engine_report.py`; the flags and the combinations refused:
`benchmarks/engine_cli.py`.

--shape mixtral: 8 layers by default (their experts are 22.5 GB). --moe-path sets every
MoE block's `SparseMoE.compute`: auto (fused on CUDA), fused (Triton), dense (every
expert on every token, fixed shapes) or grouped (one GEMM pair per hit expert; it syncs
with the host, so only with --eager). Each result row names its shape ("llama" or
"mixtral"); a mixtral's also its expected experts touched per layer.
--smoke runs either shape at tiny sizes on the CPU, eagerly.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_cli import SAMPLINGS, parse_args  # noqa: E402
from benchmarks.engine_report import StepFloor, print_table, result_doc, summarize  # noqa: E402
from benchmarks.engine_shapes import SHAPES, SMOKE, set_moe_path  # noqa: E402
from lora_core.identity import AdapterRef  # noqa: E402
from replica.block_manager import BlockManager  # noqa: E402
from replica.model_runner import ModelRunner  # noqa: E402
from replica.models.config import ModelConfig  # noqa: E402
from replica.models.llama import CausalLM  # noqa: E402
from replica.sampler import sample  # noqa: E402
from replica.sampling_params import SamplingParams  # noqa: E402
from replica.scheduler import Scheduler  # noqa: E402
from replica.sequence import Sequence  # noqa: E402
from replica.structured import Grammars, restrict  # noqa: E402
from replica.structured_spec import StructuredOutput  # noqa: E402

DEVICE = torch.device("cuda")
PROFILE = False
GRAPHS = True
SAMPLING = SAMPLINGS["greedy"]  # --sampling: the requests' sampling fields
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
        8192,
        DEVICE,
        buffers.slot_ranks,
        workspace_per_token(cfg.base_shape, rank),
        max_rank=rank,
    )
    apply_lora(model.model, buffers, ctx, stacked=STACKED)
    return model, ctx, buffers


TOKEN_BUDGET = 8192
"""Tokens a step schedules (the scheduler's max_num_batched_tokens)."""


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
    sched = Scheduler(
        BlockManager(blocks, bs, False), PreloadedSlots(num_adapters), num_seqs, TOKEN_BUDGET
    )
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

    # the prompts' prefill (TOKEN_BUDGET tokens a step), then 3 decode steps, before timing:
    # the first decode steps capture graphs and compile kernels (with 32 x 1024-token
    # prompts, 4 prefill steps, a run that timed from the 2nd one read 61-99 ms a step)
    for _ in range(-(-num_seqs * prompt_len // TOKEN_BUDGET) + 3):
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
    args = parse_args()
    global SAMPLING, SAMPLER
    SAMPLING = SAMPLINGS[args.sampling]
    if args.per_row_sampler:
        from sampler_gpu import per_row_baseline

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
    floor = StepFloor(model, cfg, buffers.nbytes / 32, bw, args.prompt_len + args.steps)
    pairs = [(s, n) for s in (32, 128) for n in (0, 8, 32)]
    if args.only:
        pairs = [tuple(int(v) for v in c.split(":")) for c in args.only.split(",")]
    combos = [(s, n, min(k, s)) for (s, n), k in itertools.product(pairs, structured)]
    runs = []
    for rnd in range(args.repeat):  # rounds over all combos: drift hits every combo alike
        for seqs, n, k in combos:
            r = run(model, ctx, cfg, seqs, n, args.prompt_len, args.steps, k)
            r.update(num_seqs=seqs, distinct_adapters=n, structured_rows=k, round=rnd)
            runs.append(r)
            print(json.dumps(r), flush=True)
    rows = summarize(runs, combos, floor, args.shape)
    print_table(rows, floor, args.moe_path)
    if args.out:
        sampling = {**SAMPLING, "sampler": SAMPLER.__name__}
        doc = result_doc(args, DEVICE, floor, GRAPHS, sampling, STRUCTURED_SCHEMA, rows)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
