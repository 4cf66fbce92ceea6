"""EngineConfig.kernel_warmup: at engine start every CUDA-graph key's layers run once
(`DecodeGraphs.warm`, `MixedGraphs.warm`, after the attention kernel's own warm-up), so no
step while serving launches a Triton kernel variant that was not compiled at start.

On CPU the kernels run in Triton's interpreter, which compiles nothing; a spy records
instead what Triton keys a compiled binary by: the kernel, its constexprs by value and,
per runtime argument, a tensor's dtype and 16-byte alignment or an int's being 1, being
divisible by 16 and fitting in 32 bits, unless the kernel names it in do_not_specialize.
What the real steps launch after warm-up must be a subset of what start-up launched."""

from __future__ import annotations

import inspect

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import _normalize_ty

from replica.cuda_graphs import DecodeGraphs, lora_keys
from replica.engine_setup import warm_graph_keys
from replica.mixed_graphs import MixedGraphs
from replica.sampling_params import SamplingParams
from tests.tiny import run_requests
from tests.unit.replica.engines import small_engine

INT32 = range(-(2**31), 2**31)


def _constexprs(fn) -> frozenset[str]:
    return frozenset(
        name for name, ty in inspect.get_annotations(fn).items() if _normalize_ty(ty) == "constexpr"
    )


def _variant(kernel, args, kwargs) -> tuple:
    const = _constexprs(kernel.fn)
    plain = set(kernel.kwargs.get("do_not_specialize") or ())
    parts = []
    for i, (name, v) in enumerate(
        [*zip(kernel.arg_names, args, strict=False), *sorted(kwargs.items())]
    ):
        if name in const:
            parts.append((name, v))
        elif name in plain or i in plain:
            parts.append((name, type(v)))
        elif isinstance(v, torch.Tensor):
            parts.append((name, v.dtype, v.data_ptr() % 16 == 0))
        elif type(v) is int:
            parts.append((name, v == 1, v % 16 == 0, v in INT32))
        else:
            parts.append((name, type(v), v))
    return (kernel.fn.__name__, tuple(parts))


@pytest.fixture
def launched(monkeypatch):
    """The Triton kernel variants launched from now on (a set the test may clear)."""
    seen: set[tuple] = set()
    run = InterpretedFunction.run

    def spy(self, *args, grid, warmup, **kwargs):
        seen.add(_variant(self, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", spy)
    monkeypatch.setenv("LORAFLEET_KERNELS", "triton")
    return seen


def _graph_objects(engine, max_tokens: int) -> tuple[DecodeGraphs, MixedGraphs]:
    """The engine's decode and mixed-step graph objects as a CUDA engine builds them, on
    CPU: the decode graphs are only warmed (no capture), the mixed ones run uncaptured."""
    r = engine.runner
    scratch = r.kv_caches[0][0].shape[0] - 1
    decode = DecodeGraphs(
        r.model, r.kv_caches, r.block_size, r.lora_ctx, scratch, engine.config.max_num_seqs, 64
    )
    return decode, MixedGraphs(r.model, r.kv_caches, r.lora_ctx, max_tokens, capture=False)


def _fill(decode: DecodeGraphs, key, n: int, count: int, width: int):
    """The buffers of decode graph `key` holding n real rows at context lengths up to
    width blocks, over `count` distinct adapter slots."""
    g = decode._buffers(key)
    g.context_lens[:n] = torch.randint(1, width * decode.block_size + 1, (n,))
    g.lora_slots[:n] = torch.arange(n) % count if count else -1
    g.positions[:n] = g.context_lens[:n] - 1
    return g


def test_steps_after_warm_up_launch_no_kernel_variant_start_up_did_not(
    launched, llama_dir, llama_adapters
):
    """A small LoRA engine (4 slots) on the Triton kernels: start-up (attention warm-up,
    then every graph key's layers) launches some set of variants; then prefill, chunked,
    mixed and decode steps with 0-4 distinct adapters through the mixed-step pieces, and
    decode graphs' forwards at real keys of several widths, launch none outside it."""
    from replica.offline import adapter_ref

    engine = small_engine(
        llama_dir, max_loras=4, max_cpu_loras=4, max_num_seqs=4, max_num_batched_tokens=24
    )
    decode, mixed = _graph_objects(engine, 24)
    warm_graph_keys(decode, mixed, torch.device("cpu"))
    at_start = set(launched)
    assert {v[0] for v in at_start} >= {"_shrink_kernel", "_expand_kernel"}
    launched.clear()

    engine.runner.mixed = mixed
    refs = [adapter_ref(n, p, max_rank=16) for n, p in sorted(llama_adapters.items())][:4]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = ["hello world how are you today", "the quick", "tenants share one base model ok"]
    reqs = [(f"r{i}", prompts[i % 3], greedy, ([None] + refs)[i % 5]) for i in range(7)]
    run_requests(engine, reqs)
    assert mixed.replays > 0
    for n, width, count in [(1, 1, 1), (3, 2, 2), (3, 5, 3), (4, 9, 0), (4, 3, 4), (2, 40, 1)]:
        key = decode.key_for(n, width, count)
        decode._forward(_fill(decode, key, n, count, width), key[2])
    new = launched - at_start
    assert not new, sorted({v[0] for v in new})


def test_warm_runs_every_key_a_step_can_have(llama_dir):
    """compile_keys holds every key key_for gives (decode: at any width, its width bucket
    aside, which only attention reads), each once."""
    engine = small_engine(llama_dir, max_loras=8, max_cpu_loras=8, max_num_seqs=48)
    decode, mixed = _graph_objects(engine, 200)
    d = decode.compile_keys()
    assert len(d) == len(set(d))
    got = {(b, s) for b, _, s in d}
    for n in range(1, 49):
        for count in range(min(n, 8) + 1):
            b, _, s = decode.key_for(n, 7, count)
            assert (b, s) in got, (n, count)
    m = mixed.compile_keys()
    assert len(m) == len(set(m))
    for n in range(1, 201):
        for count in range(min(n, 8) + 1):
            assert mixed.key_for(n, count) in m, (n, count)
    ctx = engine.runner.lora_ctx
    assert lora_keys(ctx, 8, 4) == [0, 1, 2, 4]
    assert lora_keys(None, 1 << 30, 6) == [0, 6]  # no LoRA context: one key with adapters


def test_warm_writes_no_kv_but_the_scratch_block(llama_dir):
    """Warm-up's forwards run on padding rows: every KV block the block manager hands out
    is left as it was."""
    engine = small_engine(llama_dir, max_num_seqs=4, max_num_batched_tokens=24)
    for k, v in engine.runner.kv_caches:
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in engine.runner.kv_caches]
    decode, mixed = _graph_objects(engine, 24)
    assert decode.warm() == len(decode.compile_keys()) > 0
    assert mixed.warm() == len(mixed.compile_keys()) > 0
    for (k, v), (k0, v0) in zip(engine.runner.kv_caches, before, strict=True):
        assert torch.equal(k[:-1], k0[:-1]) and torch.equal(v[:-1], v0[:-1])
        assert not torch.equal(k[-1], k0[-1])  # the scratch block took the padding rows' KV
