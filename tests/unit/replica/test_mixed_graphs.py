"""Prefill and mixed steps run piecewise (`replica.mixed_graphs`): layers' token-count work
over padded static buffers, attention eager between them. On CPU the pieces run as plain
calls (no capture), which tests everything but the capture itself: the buckets, the
padding, the buffer hand-offs between pieces and attention. The GPU tests replay the
captured graphs (tests/gpu/test_engine_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from replica.mixed_graphs import MAX_TOKENS, MixedGraphs
from replica.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy
from tests.tiny import run_requests
from tests.unit.replica.engines import small_engine

PROMPTS = ["the quick brown fox jumps over", "hello world how are you", "tenants share one base"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _piecewise(engine, max_tokens: int = 4096) -> MixedGraphs:
    r = engine.runner
    r.mixed = MixedGraphs(r.model, r.kv_caches, r.lora_ctx, max_tokens, capture=False)
    return r.mixed


def _run(engine, refs):
    names = [None, *refs, *refs]
    reqs = [
        (f"{i}-{n}", PROMPTS[i % len(PROMPTS)], GREEDY, refs[n] if n else None)
        for i, n in enumerate(names)
    ]
    return run_requests(engine, reqs)


ARCHS = {
    "llama": ("llama_dir", "llama_adapters"),
    "qwen3": ("qwen3_dir", "qwen3_adapters"),  # q/k norms in the pieces
    "mixtral": ("mixtral_dir", "mixtral_adapters"),  # padding rows routed to experts
}


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("budget", [2048, 12], ids=["whole-prompts", "chunked"])
def test_piecewise_steps_equal_eager_steps_and_hf(request, arch, budget):
    """Every step (prefill, chunked prefill beside decodes, decode) through the pieces gives
    the eager engine's tokens, and HF + PEFT's, with adapters and the base mixed."""
    from replica.offline import adapter_ref

    model_fixture, adapters_fixture = ARCHS[arch]
    model_dir = request.getfixturevalue(model_fixture)
    paths = request.getfixturevalue(adapters_fixture)
    refs = {n: adapter_ref(n, p, max_rank=16) for n, p in paths.items()}
    eager = _run(small_engine(model_dir, max_num_batched_tokens=budget), refs)
    engine = small_engine(model_dir, max_num_batched_tokens=budget)
    mixed = _piecewise(engine)
    assert _run(engine, refs) == eager
    assert mixed.replays > 0
    name = next(iter(refs))
    ids = engine.tokenizer(PROMPTS[0]).input_ids
    want = hf_greedy(model_dir, paths[name], ids, max_new_tokens=10, min_new_tokens=10)
    banned_eos = SamplingParams(max_tokens=10, min_tokens=10, temperature=0.0)
    assert run_requests(engine, [("r", PROMPTS[0], banned_eos, refs[name])])["r"] == want


def test_padding_rows_never_reach_real_rows(llama_dir, llama_adapters):
    """Rows past the step's tokens hold NaN in every buffer a piece reads: the real rows'
    hidden states equal the eager forward's, so no row's work reads another's."""
    padded_step_equals_eager(small_engine(llama_dir), llama_adapters, capture=False)


def padded_step_equals_eager(engine, adapter_paths: dict, capture: bool, tol: float = 1e-5):
    """One prefill step of three prompts (the base and two adapters) through `engine`'s
    eager forward and through MixedGraphs over NaN-poisoned buffers (shared with the GPU
    test, which captures) -> the MixedGraphs."""
    from replica.offline import adapter_ref
    from replica.sequence import Sequence

    refs = {n: adapter_ref(n, p, max_rank=16) for n, p in adapter_paths.items()}
    names = list(refs)[:2]
    for i, name in enumerate(names):  # load two adapters into the slots
        engine.add_request(f"w{i}", [1, 2, 3], GREEDY, refs[name])
    while engine.has_unfinished():
        engine.step()
    ids = engine.tokenizer(PROMPTS[0]).input_ids
    for i, name in enumerate([None, *names]):
        ref = refs[name] if name else None
        engine.scheduler.add(Sequence(f"p{i}", len(ids), list(ids), GREEDY, ref, i))
    runner = engine.runner
    batch = runner.prepare(engine.scheduler.schedule().scheduled)
    t = batch.input_ids.shape[0]
    assert batch.lora_count == 2 and t > 8
    runner.mixed = None
    want = runner.forward(batch).clone()
    mixed = _piecewise(engine)
    mixed.capture = capture
    key = mixed.key_for(t, batch.lora_count)
    assert key[0] > t  # padded
    for buf in (mixed.x, mixed.q, mixed.k, mixed.v, mixed.attn, mixed.cos, mixed.sin):
        buf.fill_(float("nan"))
    for _ in range(2):  # the first run captures (where capture is on), the second replays
        got = mixed.run(key, batch)
        assert got.shape == want.shape and torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert mixed.replays == 2
    return mixed


def test_key_is_the_smallest_bucket_holding_the_step(llama_dir):
    engine = small_engine(llama_dir, max_num_batched_tokens=1000)
    mixed = _piecewise(engine, max_tokens=1000)
    assert mixed.token_buckets[-1] == 1000
    for t in (1, 7, 8, 9, 100, 129, 385, 999, 1000):
        b, lora = mixed.key_for(t, 0)
        assert lora == 0
        assert b >= t and not any(t <= x < b for x in mixed.token_buckets)
        assert b <= max(8, int(t * 2))  # padding at most doubles a step
        if t > 256:
            assert b - t < 128 if t > 1024 else b - t < 64  # GPU-bound steps pad little
    assert mixed.key_for(1001, 0) is None
    assert mixed.key_for(0, 0) is None
    b, lora = mixed.key_for(5, 2)
    assert (b, lora) == (8, 2)  # two adapters of the pool's 2 slots


def test_buckets_stop_at_the_lora_tokens_and_max_tokens(llama_dir):
    engine = small_engine(llama_dir, max_num_batched_tokens=300)
    assert _piecewise(engine, max_tokens=4096).token_buckets[-1] == 300  # the LoRA context's
    engine = small_engine(llama_dir, max_num_batched_tokens=8192)
    assert _piecewise(engine, max_tokens=8192).token_buckets[-1] == MAX_TOKENS
