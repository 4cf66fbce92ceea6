"""Engine behaviour on a tiny model: batch invariance, prefix-cache isolation between
adapters, sampling controls, abort, unload draining, pins, preemption."""

from __future__ import annotations

import asyncio

import pytest

from lora_core.errors import AdapterDraining, AdapterNotFound, InvalidRequest, PinRefused
from replica.async_engine import AsyncEngine
from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.offline import adapter_ref
from replica.sampling_params import SamplingParams
from router.errors import status_for
from tests.polling import wait_for_async
from tests.tiny import run_requests
from tests.unit.replica.engines import small_engine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [
    "hello world how are you today",
    "the quick brown fox jumps over the lazy dog while tenants share",
    "what",
    "serving routing memory kernels batches tokens prefix cache replica",
]


def _engine(model_dir, **kw) -> LLMEngine:
    return small_engine(model_dir, **kw)


def test_mixed_batch_equals_each_request_alone(llama_dir, refs):
    engine = _engine(llama_dir, max_num_batched_tokens=24)
    names = [None, "qv8", "all16rs", "mlp4", "pattern"]
    reqs = [
        (f"{i}", PROMPTS[i % 4], GREEDY, refs[n] if n else None) for i, n in enumerate(names * 2)
    ]
    together = run_requests(engine, reqs)
    alone = {}
    for req in reqs:
        alone.update(run_requests(_engine(llama_dir), [req]))
    assert together == alone
    assert len({tuple(v) for v in together.values()}) > 4  # adapters change outputs


@pytest.mark.parametrize("adapter", [None, "qv8"])
def test_cache_salts_keep_blocks_apart(llama_dir, refs, adapter):
    """Requests share prefix-cache blocks (and park on each other's) only under one salt."""
    engine = _engine(llama_dir)
    ids = engine.tokenizer(PROMPTS[1]).input_ids
    ref = refs[adapter] if adapter else None

    def run(rid: str, salt: str) -> list[int]:
        engine.add_request(rid, ids, GREEDY, ref, cache_salt=salt)
        out = []
        while engine.has_unfinished():
            out += [t for o in engine.step() for t in o.new_token_ids]
        return out

    first = run("t1-a", "t1\x00")
    assert run("t2", "t2\x00") == first and engine.blocks.prefix_hit_tokens == 0
    assert run("none", "") == first and engine.blocks.prefix_hit_tokens == 0
    assert run("t1-b", "t1\x00") == first and engine.blocks.prefix_hit_tokens > 0


def test_same_prompt_two_adapters_share_no_blocks(llama_dir, refs):
    engine = _engine(llama_dir)
    prompt = PROMPTS[1]
    run_requests(engine, [("a1", prompt, GREEDY, refs["qv8"])])
    assert engine.blocks.prefix_hit_tokens == 0
    run_requests(engine, [("b1", prompt, GREEDY, refs["mlp4"])])
    assert engine.blocks.prefix_hit_tokens == 0  # other adapter: no reuse
    run_requests(engine, [("base", prompt, GREEDY, None)])
    assert engine.blocks.prefix_hit_tokens == 0  # base model: no reuse either
    again = run_requests(engine, [("a2", prompt, GREEDY, refs["qv8"])])
    assert engine.blocks.prefix_hit_tokens > 0  # same adapter: reused
    assert (
        again["a2"]
        == run_requests(
            _engine(llama_dir, enable_prefix_caching=False), [("x", prompt, GREEDY, refs["qv8"])]
        )["x"]
    )


def test_requests_arriving_together_compute_their_shared_prompt_once(llama_dir, refs):
    """Four choices of one prompt under qv8 and two of it on the base model, queued
    together: each group computes the prompt once (the others park and take its blocks),
    and every request answers exactly as it does alone."""
    engine = _engine(llama_dir, max_num_batched_tokens=16)
    prompt = list(range(40, 63))  # 5 full blocks of 4 and 3 tokens
    reqs = [(f"a{i}", refs["qv8"]) for i in range(4)] + [("b0", None), ("b1", None)]
    for rid, ref in reqs:
        engine.add_request(rid, prompt, GREEDY, ref)
    together: dict[str, list[int]] = {rid: [] for rid, _ in reqs}
    while engine.has_unfinished():
        for o in engine.step():
            together[o.request_id] += o.new_token_ids
    # per group: the prompt once, 3 tokens per follower, then 7 decode steps each
    computed = engine.stats().computed_tokens
    assert computed == 2 * len(prompt) + 4 * 3 + len(reqs) * (GREEDY.max_tokens - 1)
    assert engine.scheduler.num_parked == 4 and engine.blocks.prefix_hit_tokens == 4 * 20
    alone = _engine(llama_dir, enable_prefix_caching=False)
    for rid, ref in reqs:
        alone.add_request(rid, prompt, GREEDY, ref)
        assert together[rid] == next(iter(_drain_ids(alone).values()))
    assert together["a0"] != together["b0"]


def _drain_ids(engine: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_seeded_sampling_is_reproducible(llama_dir, refs):
    p = SamplingParams(
        max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=42, ignore_eos=True
    )
    a = run_requests(
        _engine(llama_dir), [("x", PROMPTS[0], p, refs["qv8"]), ("y", PROMPTS[1], GREEDY, None)]
    )["x"]
    b = run_requests(_engine(llama_dir), [("x", PROMPTS[0], p, refs["qv8"])])["x"]
    assert a == b
    other = SamplingParams(
        max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=43, ignore_eos=True
    )
    assert run_requests(_engine(llama_dir), [("x", PROMPTS[0], other, refs["qv8"])])["x"] != a


def test_engine_seed_makes_unseeded_sampling_reproducible(llama_dir, refs):
    """EngineConfig.seed: requests without a seed draw reproducibly from it (two
    identical ones still differ); another engine seed draws other tokens."""
    p = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    reqs = [("x", PROMPTS[0], p, refs["qv8"]), ("y", PROMPTS[0], p, refs["qv8"])]
    a = run_requests(_engine(llama_dir, seed=7), reqs)
    assert a == run_requests(_engine(llama_dir, seed=7), reqs)
    assert a["x"] != a["y"]
    assert run_requests(_engine(llama_dir, seed=8), reqs) != a


def test_stop_strings_stop_token_ids_and_finish_reasons(llama_dir):
    engine = _engine(llama_dir)
    base = run_requests(
        engine,
        [
            (
                "ref",
                PROMPTS[0],
                SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                None,
            )
        ],
    )["ref"]
    full_text = engine.tokenizer.decode(base)
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 2]
    assert stop.strip(), full_text
    engine.add_request(
        "s",
        engine.tokenizer(PROMPTS[0]).input_ids,
        SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,), ignore_eos=True),
    )
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    text = "".join(o.new_text for o in outs)
    assert outs[-1].finish_reason == "stop"
    assert text == full_text[: full_text.find(stop)]
    engine.add_request(
        "t",
        engine.tokenizer(PROMPTS[0]).input_ids,
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(base[3],), ignore_eos=True),
    )
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    cut = base.index(base[3])
    assert [t for o in outs for t in o.new_token_ids] == base[: cut + 1]
    assert outs[-1].finish_reason == "stop"
    # vLLM (include_stop_str_in_output=False): the stop token's id is kept, its text is not
    assert engine.tokenizer.decode(base[cut : cut + 1]), "stop token must have text"
    assert "".join(o.new_text for o in outs) == engine.tokenizer.decode(base[:cut])


def test_logprobs_and_usage(llama_dir):
    engine = _engine(llama_dir)
    engine.add_request(
        "l",
        engine.tokenizer(PROMPTS[2]).input_ids,
        SamplingParams(max_tokens=5, temperature=0.0, logprobs=True, ignore_eos=True),
    )
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    lps = [lp for o in outs for lp in o.new_logprobs]
    assert len(lps) == 5 and all(lp <= 0.0 for lp in lps)
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 5


def test_abort_frees_everything(llama_dir, refs):
    engine = _engine(llama_dir)
    engine.add_request("a", engine.tokenizer(PROMPTS[1]).input_ids, GREEDY, refs["qv8"])
    engine.step()
    assert engine.stats().num_running == 1
    assert engine.abort("a")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "abort")]
    assert engine.stats().num_running == 0 and engine.blocks.usage() == 0.0
    assert not engine.has_unfinished()


def test_bad_requests_are_refused(llama_dir):
    engine = _engine(llama_dir, max_model_len=32)
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add_request("e", [], GREEDY)
    with pytest.raises(InvalidRequest, match="token ids"):
        engine.add_request("v", [10**6], GREEDY)
    with pytest.raises(InvalidRequest, match="maximum context length 32"):
        engine.add_request("l", [1] * 30, GREEDY)
    engine.add_request("ok", [1, 2], GREEDY)
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request("ok", [1, 2], GREEDY)


def test_request_larger_than_the_whole_kv_cache_is_a_bad_request(llama_dir):
    """A request that needs more KV than the cache holds can never run: it is refused as
    invalid (400, naming the most max_tokens that fits), not as backpressure (429 with
    Retry-After), which clients retry forever. A chat request without max_tokens hit this
    on every call where kv_cache_tokens < max_model_len (the default is the whole room)."""
    engine = _engine(llama_dir, num_kv_blocks=6)  # 24 tokens of KV, max_model_len 1024
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    with pytest.raises(InvalidRequest, match="holds 24 tokens.*max_tokens up to 19") as e:
        engine.add_request("big", [1, 2, 3, 4, 5], params)
    assert not e.value.retryable and e.value.param == "max_tokens"
    assert status_for(e.value).http == 400
    with pytest.raises(InvalidRequest, match="prompt: 24 tokens .*holds 24 tokens") as e:
        engine.add_request("long", [1] * 24, GREEDY)
    assert e.value.param == "prompt"
    fits = SamplingParams(max_tokens=19, temperature=0.0, ignore_eos=True)
    assert len(run_requests(engine, [("fits", "a b c", fits, None)])["fits"]) == 19


def test_preemption_gives_the_same_tokens(llama_dir, refs):
    reqs = [
        (
            str(i),
            PROMPTS[i],
            SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
            refs["all16rs"] if i % 2 else None,
        )
        for i in range(4)
    ]
    tight = _engine(llama_dir, num_kv_blocks=14)
    got = run_requests(tight, reqs)
    assert tight.scheduler.num_preemptions > 0
    assert got == run_requests(_engine(llama_dir), reqs)


def test_unload_refuses_new_lets_inflight_finish_then_frees(llama_dir, refs):
    engine = _engine(llama_dir)
    ref = refs["qv8"]
    engine.add_request("inflight", engine.tokenizer(PROMPTS[0]).input_ids, GREEDY, ref)
    tokens = [t for o in engine.step() for t in o.new_token_ids]
    engine.adapters.unload(ref.name)
    with pytest.raises(AdapterDraining):
        engine.add_request("new", [1, 2, 3], GREEDY, ref)
    assert ref.key in engine.stats().gpu_adapters  # still serving the in-flight request
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.new_token_ids
    assert len(tokens) == GREEDY.max_tokens
    s = engine.stats()
    assert ref.key not in s.gpu_adapters and ref.key not in s.cpu_adapters and s.free_slots == 2


# An unloaded adapter no request holds is purged at once (AdapterNotFound); one still held
# drains (AdapterDraining). The ingress answers both with the same 404.
GONE = (AdapterNotFound, AdapterDraining)


def _unload_while_waiting(engine, refs, ids):
    """qv8 runs in the only slot, mlp4 waits for it, a base request runs beside them;
    then mlp4 is unloaded."""
    engine.add_request("running", ids, GREEDY, refs["qv8"])
    engine.add_request("base", ids, GREEDY, None)
    engine.add_request("waiting", ids, GREEDY, refs["mlp4"])
    first = engine.step()
    assert engine.stats().num_waiting == 1
    engine.adapters.unload(refs["mlp4"].name)
    return first


def test_unload_while_waiting_fails_that_request_alone(llama_dir, refs):
    engine = _engine(llama_dir, max_loras=1)
    ids = engine.tokenizer(PROMPTS[0]).input_ids
    outs: dict[str, list] = {"running": [], "base": [], "waiting": []}
    for o in _unload_while_waiting(engine, refs, ids):
        outs[o.request_id].append(o)
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    (failed,) = outs["waiting"]
    assert failed.finish_reason == "error" and isinstance(failed.error, GONE)
    expected = run_requests(
        _engine(llama_dir), [("running", PROMPTS[0], GREEDY, refs["qv8"]),
                             ("base", PROMPTS[0], GREEDY, None)]
    )  # fmt: skip
    for rid in ("running", "base"):
        assert outs[rid][-1].finish_reason == "length" and outs[rid][-1].error is None
        assert [t for o in outs[rid] for t in o.new_token_ids] == expected[rid]
    assert engine.stats().num_waiting == 0


def test_async_unload_while_waiting_raises_to_that_caller_only(llama_dir, refs):
    engine = AsyncEngine(
        EngineConfig(model=str(llama_dir), device="cpu", max_loras=1, max_cpu_loras=4,
                     max_lora_rank=16)
    )  # fmt: skip
    ids = engine.tokenizer(PROMPTS[0]).input_ids
    # long enough that the unload lands while "running" still holds the only slot, even
    # on a loaded machine (once it finished, "waiting" would take the slot and be served)
    long = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)

    async def collect(rid, ref):
        try:
            return [t async for o in engine.generate(rid, ids, long, ref) for t in o.new_token_ids]
        except GONE as e:
            return e

    async def main():
        tasks = [asyncio.create_task(collect(r, ref)) for r, ref in
                 [("running", refs["qv8"]), ("base", None)]]  # fmt: skip
        # "waiting" comes once qv8 holds the slot: added together, whichever adapter's
        # load finished first took the slot, and mlp4 sometimes ran instead of waiting
        await wait_for_async(
            lambda: engine.stats().num_running == 2, 30, "running and base running", 0.001
        )
        tasks.append(asyncio.create_task(collect("waiting", refs["mlp4"])))
        await wait_for_async(
            lambda: engine.stats().num_waiting == 1 and engine.stats().num_running == 2,
            30,
            "waiting queued behind the 2 running",
            0.001,
        )
        await engine.unload_adapter(refs["mlp4"].name)
        return await asyncio.gather(*tasks)

    try:
        running, base, waiting = asyncio.run(main())
        assert isinstance(waiting, GONE)
        assert len(running) == len(base) == long.max_tokens
    finally:
        engine.shutdown()


def test_pinning_every_slot_is_refused(llama_dir, refs):
    engine = _engine(llama_dir)
    engine.adapters.register(refs["qv8"])
    engine.adapters.register(refs["mlp4"])
    engine.adapters.pin(refs["qv8"])
    with pytest.raises(PinRefused):
        engine.adapters.pin(refs["mlp4"])
    engine.adapters.unpin(refs["qv8"])
    engine.adapters.pin(refs["mlp4"])


def test_async_engine_streams_and_cancel_aborts(llama_dir, refs):
    engine = AsyncEngine(
        EngineConfig(
            model=str(llama_dir), device="cpu", max_loras=2, max_cpu_loras=4, max_lora_rank=16
        )
    )
    ids = engine.tokenizer(PROMPTS[0]).input_ids

    async def collect(rid, ref):
        return [o async for o in engine.generate(rid, ids, GREEDY, ref)]

    async def main():
        outs = await asyncio.gather(collect("a", refs["qv8"]), collect("b", None))
        agen = engine.generate(
            "c", ids, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True), refs["qv8"]
        )
        first = await agen.__anext__()
        await agen.aclose()
        return outs, first

    try:
        (a, b), first = asyncio.run(main())
        expected = run_requests(
            _engine(llama_dir),
            [("a", PROMPTS[0], GREEDY, refs["qv8"]), ("b", PROMPTS[0], GREEDY, None)],
        )
        assert [t for o in a for t in o.new_token_ids] == expected["a"]
        assert [t for o in b for t in o.new_token_ids] == expected["b"]
        assert a[-1].finish_reason == "length" and first.new_token_ids
        stats = engine.stats()
        assert stats.num_running == 0 and stats.num_waiting == 0
    finally:
        engine.shutdown()


def test_async_stats_never_wait_for_a_running_step(llama_dir):
    """Health checks and routing-stats polls run on the replica's event loop: they read a
    snapshot instead of waiting for the engine lock that a long step holds."""
    from concurrent.futures import ThreadPoolExecutor

    engine = AsyncEngine(
        EngineConfig(
            model=str(llama_dir), device="cpu", max_loras=2, max_cpu_loras=4, max_lora_rank=16
        )
    )
    try:
        # read from another thread while this one holds the lock, as a long prefill step
        # does: a read waiting for the lock would wait until the lock is released, and
        # the 10 s timeout ends it first (however slowly a loaded machine runs the read)
        with ThreadPoolExecutor(1) as pool, engine._lock:
            stats = pool.submit(engine.stats).result(timeout=10)
        assert stats.num_running == 0 and stats.free_slots == 2
    finally:
        engine.shutdown()


def test_async_load_to_gpu_warms_a_slot_even_with_one_slot(llama_dir, refs):
    """Warming (load_adapter to_gpu) places the adapter in a slot without pinning it, so it
    works with max_loras 1, where pinning is always refused."""
    engine = AsyncEngine(
        EngineConfig(
            model=str(llama_dir), device="cpu", max_loras=1, max_cpu_loras=2, max_lora_rank=16
        )
    )
    try:
        asyncio.run(engine.load_adapter(refs["qv8"], to_gpu=True))
        stats = engine.stats()
        assert stats.gpu_adapters == (refs["qv8"].key,) and stats.pinned == ()
    finally:
        engine.shutdown()


def test_overflowing_adapter_fails_its_requests_alone(llama_dir, refs, tmp_path):
    """An adapter with finite but huge weights (so validation takes it) overflows float32:
    its requests stop with NonFiniteLogits instead of emitting arbitrary tokens; the base
    and other-adapter requests beside it are untouched and everything is freed."""
    from lora_core.errors import NonFiniteLogits
    from tests.tiny import make_peft_adapter

    path = make_peft_adapter(
        llama_dir, tmp_path / "huge", seed=3, scale=1e20, r=4, lora_alpha=8,
        target_modules=["down_proj"],
    )  # fmt: skip
    huge = adapter_ref("huge", path, max_rank=16)
    engine = _engine(llama_dir)
    ids = engine.tokenizer(PROMPTS[1]).input_ids
    engine.add_request("huge", ids, GREEDY, huge)
    engine.add_request("base", ids, GREEDY, None)
    engine.add_request("qv8", ids, GREEDY, refs["qv8"])
    outs: dict[str, list] = {"huge": [], "base": [], "qv8": []}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    (failed,) = outs["huge"]
    assert failed.finish_reason == "error" and isinstance(failed.error, NonFiniteLogits)
    assert failed.new_token_ids == [] and "not finite" in str(failed.error)
    expected = run_requests(
        _engine(llama_dir), [("base", PROMPTS[1], GREEDY, None),
                             ("qv8", PROMPTS[1], GREEDY, refs["qv8"])]
    )  # fmt: skip
    for rid in ("base", "qv8"):
        assert [t for o in outs[rid] for t in o.new_token_ids] == expected[rid]
        assert outs[rid][-1].finish_reason == "length"
    assert engine.stats().num_running == 0 and engine.blocks.usage() == 0.0
