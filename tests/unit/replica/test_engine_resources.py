"""Engine resource lifecycle on a tiny model: in-flight requests of an unloaded adapter
survive preemption, and unloads, aborts and preemption leave no KV block, slot or
adapter memory behind."""

from __future__ import annotations

import pytest

from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.offline import adapter_ref
from replica.sampling_params import SamplingParams
from tests.unit.replica.engines import small_engine

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _engine(model_dir, **kw) -> LLMEngine:
    return small_engine(model_dir, **kw)


def _alone(model_dir, requests, params=GREEDY) -> dict[str, list[int]]:
    """[(rid, prompt ids, adapter ref)] run one at a time on a roomy engine -> tokens."""
    engine, out = _engine(model_dir), {}
    for rid, ids, adapter in requests:
        engine.add_request(rid, ids, params, adapter)
        outs: dict[str, list] = {rid: []}
        _drain(engine, outs)
        out[rid] = [t for o in outs[rid] for t in o.new_token_ids]
    return out


def _drain(engine: LLMEngine, outs: dict[str, list]) -> None:
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)


def test_unloaded_adapter_inflight_request_survives_preemption(llama_dir, refs):
    """An unload lets in-flight requests finish: one that is preempted afterwards (KV
    ran out) must still finish with the same tokens, not fail with AdapterNotFound
    because its preemption released the draining adapter's last reference."""
    ref = refs["qv8"]
    base_ids, lora_ids = list(range(1, 9)), list(range(20, 25))
    # 8 + 10 and 5 + 10 tokens need 5 + 4 blocks of 4: only 6 exist, so one is preempted
    engine = _engine(llama_dir, num_kv_blocks=6)
    engine.add_request("base", base_ids, GREEDY)
    engine.add_request("lora", lora_ids, GREEDY, ref)
    outs: dict[str, list] = {"base": [], "lora": []}
    for o in engine.step():
        outs[o.request_id].append(o)
    engine.adapters.unload(ref.name)
    _drain(engine, outs)
    assert engine.scheduler.num_preemptions > 0
    expected = _alone(llama_dir, [("base", base_ids, None), ("lora", lora_ids, ref)])
    for rid in ("base", "lora"):
        assert outs[rid][-1].error is None and outs[rid][-1].finish_reason == "length"
        assert [t for o in outs[rid] for t in o.new_token_ids] == expected[rid]
    s = engine.stats()
    assert ref.key not in s.gpu_adapters and ref.key not in s.cpu_adapters
    assert s.free_slots == 2 and engine.adapters.cpu_nbytes == 0
    assert engine.blocks.usage() == 0.0


def test_async_duplicate_request_id_is_refused_without_hurting_the_first(llama_dir):
    """A second generate() with an id in flight is refused; the first keeps streaming
    (its queue was replaced and then dropped, so it waited forever)."""
    import asyncio

    from lora_core.errors import InvalidRequest
    from replica.async_engine import AsyncEngine

    engine = AsyncEngine(
        EngineConfig(model=str(llama_dir), device="cpu", max_loras=1, max_cpu_loras=1)
    )
    # long enough that "x" is still running when the second call comes, even though the
    # engine thread keeps stepping meanwhile
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)

    async def main():
        first = engine.generate("x", [1, 2, 3], params)
        tokens = list((await first.__anext__()).new_token_ids)
        with pytest.raises(InvalidRequest, match="already in use"):
            await anext(aiter(engine.generate("x", [4, 5], params)))
        async for o in first:
            tokens += o.new_token_ids
        return tokens

    try:
        tokens = asyncio.run(asyncio.wait_for(main(), timeout=30))
        assert tokens == _alone(llama_dir, [("x", [1, 2, 3], None)], params)["x"]
    finally:
        engine.shutdown()


def test_async_caller_leaving_while_its_adapter_loads_leaves_no_request(llama_dir, refs):
    """The caller leaves while its cold adapter is still being read (outside the engine
    lock): the request that the loading thread queues afterwards is aborted, not run to
    max_tokens with nobody reading."""
    import asyncio
    import threading

    from replica.async_engine import AsyncEngine
    from tests.polling import wait_for_async

    engine = AsyncEngine(
        EngineConfig(model=str(llama_dir), device="cpu", max_loras=1, max_cpu_loras=1)
    )
    core = engine.engine
    entered, release, landed = threading.Event(), threading.Event(), threading.Event()
    register, add_request, abort = core.adapters.register, core.add_request, core.abort
    aborts: list[tuple[str, bool]] = []

    def slow_register(ref):
        entered.set()
        release.wait(10)
        return register(ref)

    def recording_add(*args, **kwargs):
        add_request(*args, **kwargs)
        landed.set()

    def recording_abort(rid):
        aborts.append((rid, abort(rid)))
        return aborts[-1][1]

    core.adapters.register, core.add_request, core.abort = (
        slow_register,
        recording_add,
        recording_abort,
    )
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)

    async def main():
        task = asyncio.create_task(anext(aiter(engine.generate("x", [1, 2], params, refs["qv8"]))))
        await wait_for_async(entered.is_set, 30, "the adapter's read starting", 0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        await wait_for_async(
            lambda: landed.is_set() and engine._locked(lambda: "x" not in core._seqs),
            20,
            "the late request queued and then aborted",
            0.001,
        )

    try:
        asyncio.run(main())
        assert aborts == [("x", True)]
        assert core.adapters.stats().wanted == ()  # the load's want went out with the abort
    finally:
        engine.shutdown()


def test_reregistered_name_never_reuses_the_old_versions_prefix_blocks(
    llama_dir, llama_adapters, tmp_path
):
    """The name qv8 re-registered (version 2, new weights) on an engine that still caches
    version 1's prompt blocks: version 2 reuses none of them and equals HF + PEFT with
    the new weights; version 1 still hits its own blocks."""
    import torch
    import transformers
    from peft import PeftModel

    from tests.tiny import ADAPTER_SPECS, make_peft_adapter

    new_dir = make_peft_adapter(llama_dir, tmp_path / "qv8-new", seed=99, **ADAPTER_SPECS["qv8"])
    v1 = adapter_ref("qv8", llama_adapters["qv8"], max_rank=16, version=1)
    v2 = adapter_ref("qv8", new_dir, max_rank=16, version=2)
    prompt = list(range(40, 53))  # three full blocks of 4 and one token
    engine = _engine(llama_dir)
    first = _alone_on(engine, "a", prompt, v1)
    hits = engine.blocks.prefix_hit_tokens
    second = _alone_on(engine, "b", prompt, v2)
    assert engine.blocks.prefix_hit_tokens == hits
    assert _alone_on(engine, "c", prompt, v1) == first
    assert engine.blocks.prefix_hit_tokens == hits + 12

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    hf = PeftModel.from_pretrained(hf, str(new_dir)).eval()
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(GREEDY.max_tokens):
            tokens.append(int(hf(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    assert second == tokens[len(prompt) :] and second != first


def _alone_on(engine: LLMEngine, rid: str, ids: list[int], adapter) -> list[int]:
    engine.add_request(rid, ids, GREEDY, adapter)
    outs: dict[str, list] = {rid: []}
    _drain(engine, outs)
    return [t for o in outs[rid] for t in o.new_token_ids]


def test_async_reads_a_dropped_adapter_back_before_queueing(llama_dir, refs, monkeypatch):
    """An adapter known to the engine but dropped from its CPU cache is read back from
    disk in the caller's thread, outside the engine lock; left to the scheduler's
    acquire, the read ran on the engine thread and stalled every running request."""
    import asyncio
    import threading

    import lora_core.manager
    from replica.async_engine import AsyncEngine

    engine = AsyncEngine(
        EngineConfig(model=str(llama_dir), device="cpu", max_loras=1, max_cpu_loras=1)
    )
    read_on: list[str] = []
    load = lora_core.manager.load_adapter_weights

    def recording_load(*args, **kwargs):
        read_on.append(threading.current_thread().name)
        return load(*args, **kwargs)

    monkeypatch.setattr(lora_core.manager, "load_adapter_weights", recording_load)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        engine.engine.adapters.register(refs["qv8"])
        engine.engine.adapters.register(refs["mlp4"])  # the only CPU entry: qv8 is dropped
        assert engine.engine.adapters.stats().cpu_keys == (refs["mlp4"].key,)
        read_on.clear()

        async def main():
            return [t async for o in engine.generate("x", [1, 2, 3], params, refs["qv8"])
                    for t in o.new_token_ids]  # fmt: skip

        tokens = asyncio.run(main())
        assert read_on and "lorafleet-engine" not in read_on
        assert tokens == _alone(llama_dir, [("x", [1, 2, 3], refs["qv8"])], params)["x"]
    finally:
        engine.shutdown()


def test_more_waiting_adapters_than_cpu_cache_entries_all_finish(llama_dir, refs):
    """One slot and one CPU-cache entry, every adapter queued twice, interleaved: each
    registration drops an adapter a waiting request needs from the CPU cache. A dropped
    adapter stays known (only its weights leave memory), so its request reads it back
    when it gets the slot: every request finishes with its own tokens, in a bounded
    number of steps (each one runs at least one request)."""
    tok = _engine(llama_dir).tokenizer
    prompts = ["hello world how", "the quick brown fox jumps", "what"]
    requests = [
        (f"{name}-{i}", tok(prompts[i % len(prompts)]).input_ids, refs[name])
        for i in range(2)
        for name in sorted(refs)
    ]
    engine = _engine(llama_dir, max_loras=1, max_cpu_loras=1, max_num_seqs=4)
    for rid, ids, ref in requests:
        engine.add_request(rid, ids, GREEDY, ref)
    assert len(engine.stats().cpu_adapters) == 1
    outs: dict[str, list] = {rid: [] for rid, *_ in requests}
    bound = sum(len(ids) + GREEDY.max_tokens for _, ids, _ in requests)
    for _ in range(bound):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            outs[o.request_id].append(o)
    assert not engine.has_unfinished()
    got = {rid: [t for o in os_ for t in o.new_token_ids] for rid, os_ in outs.items()}
    assert got == _alone(llama_dir, requests)
    assert all(os_[-1].finish_reason == "length" for os_ in outs.values())
    assert engine.stats().adapter_loads >= len(refs)
