"""The async front wants a request's adapter from the moment it starts loading it: other
registrations between that load and the queueing (the CPU cache full) drop another
entry, not the copy just loaded, so the slot is filled from CPU, not from disk under the
engine lock. The scheduler takes the count over at queueing; a request refused, failed,
unloaded or abandoned before or after queueing leaves no count behind."""

from __future__ import annotations

import asyncio
import shutil
import threading

import pytest

from lora_core.errors import AdapterDraining, AdapterLoadFailed, AdapterNotFound, InvalidRequest
from replica.async_engine import AsyncEngine
from replica.config import EngineConfig
from replica.offline import adapter_ref
from replica.sampling_params import SamplingParams
from tests.polling import wait_for_async
from tests.tiny import run_requests
from tests.unit.replica.engines import small_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
PROMPT = "hello world how are you"


def _async_engine(model_dir, max_cpu_loras: int = 2) -> AsyncEngine:
    """One slot and a small CPU cache, so two registrations fill it."""
    return AsyncEngine(
        EngineConfig(
            model=str(model_dir),
            device="cpu",
            max_loras=1,
            max_cpu_loras=max_cpu_loras,
            max_lora_rank=16,
            block_size=4,
        )
    )


async def _tokens(engine: AsyncEngine, rid: str, ref, params=GREEDY, ids=None) -> list[int]:
    ids = engine.tokenizer(PROMPT).input_ids if ids is None else ids
    return [t async for o in engine.generate(rid, ids, params, ref) for t in o.new_token_ids]


def _after_fetch(engine: AsyncEngine, then) -> None:
    """Run then(ref) right after the front's fetch(ref) returns (before the queueing)."""
    adapters = engine.engine.adapters
    fetch = adapters.fetch

    def fetch_then(ref):
        manifest = fetch(ref)
        then(ref)
        return manifest

    adapters.fetch = fetch_then


def test_loaded_adapter_survives_registrations_before_queueing(llama_dir, refs):
    """CPU cache of 2: mlp4 is loaded for a request, then pattern and all16rs register
    before it is queued. Without the early want, LRU dropped mlp4 for all16rs and the
    slot was filled from disk under the engine lock; now pattern goes."""
    engine = _async_engine(llama_dir)
    adapters = engine.engine.adapters
    seen = {}

    def others(ref):
        seen["wanted"] = adapters.pool.wanted(ref.key)
        for name in ("pattern", "all16rs"):  # all16rs finds the cache full
            adapters.register(refs[name])
        seen["cpu"] = adapters.stats().cpu_keys

    _after_fetch(engine, others)
    try:
        got = asyncio.run(_tokens(engine, "r", refs["mlp4"]))
        stats = adapters.stats()
    finally:
        engine.shutdown()
    assert seen == {"wanted": 1, "cpu": (refs["mlp4"].key, refs["all16rs"].key)}
    assert (stats.loads_from_cpu, stats.loads_from_disk) == (1, 0)
    assert stats.wanted == ()
    want = run_requests(small_engine(llama_dir), [("r", PROMPT, GREEDY, refs["mlp4"])])
    assert got == want["r"]


def _unload_and_delete(engine: AsyncEngine, path):
    """After the load: unload the adapter (forgotten: nothing uses it) and delete its
    files, so the queueing's register reads them again and fails."""

    def then(ref):
        engine.engine.adapters.unload(ref.name)
        shutil.rmtree(path)

    return then


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("files gone", AdapterLoadFailed),  # fetch raises
        ("empty prompt", InvalidRequest),  # add_request refuses after the load
        ("unloaded before queueing", AdapterLoadFailed),  # add_request's register raises
    ],
)
def test_failures_before_queueing_leave_no_count(llama_dir, llama_adapters, tmp_path, case, error):
    shutil.copytree(llama_adapters["mlp4"], tmp_path / "mlp4")
    ref = adapter_ref("mlp4", tmp_path / "mlp4", max_rank=16)
    engine = _async_engine(llama_dir)
    ids = None
    if case == "files gone":
        shutil.rmtree(tmp_path / "mlp4")
    elif case == "empty prompt":
        ids = []
    else:
        _after_fetch(engine, _unload_and_delete(engine, tmp_path / "mlp4"))
    try:
        with pytest.raises(error):
            asyncio.run(_tokens(engine, "r", ref, ids=ids))
        stats = engine.engine.adapters.stats()
        assert engine.engine.adapters.pool.wanted(ref.key) == 0 and stats.wanted == ()
        assert engine.stats().num_waiting == 0
    finally:
        engine.shutdown()


def test_caller_leaving_while_the_adapter_loads_leaves_no_count(llama_dir, refs):
    """The caller is cancelled while its adapter loads; the load finishes, the request
    is queued and aborted at once: the count goes to the queue and out with the abort."""
    engine = _async_engine(llama_dir)
    adapters = engine.engine.adapters
    loading, release = threading.Event(), threading.Event()

    def stall(ref):
        loading.set()
        release.wait(10)

    _after_fetch(engine, stall)

    async def main():
        task = asyncio.create_task(_tokens(engine, "r", refs["mlp4"]))
        await wait_for_async(loading.is_set, 20, "mlp4's load starting", 0.001)
        assert adapters.pool.wanted(refs["mlp4"].key) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        await wait_for_async(
            lambda: not adapters.stats().wanted and not engine.engine.has_unfinished(),
            20,
            "no count and no request left",
            0.005,
        )

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
        assert engine.stats().num_waiting == engine.stats().num_running == 0
    finally:
        engine.shutdown()


def test_aborted_or_failed_while_queued_leaves_no_count(llama_dir, refs):
    """qv8 holds the only slot; mlp4's and all16rs's requests wait for it (one count
    each, handed over at queueing); the mlp4 caller leaves, all16rs is unloaded (its
    request fails): no count is left, and the running request is unaffected."""
    engine = _async_engine(llama_dir, max_cpu_loras=4)
    adapters = engine.engine.adapters

    async def main():
        running = asyncio.create_task(_tokens(engine, "run", refs["qv8"], LONG))
        await wait_for_async(lambda: engine.stats().num_running == 1, 30, "qv8 running", 0.001)
        left = asyncio.create_task(_tokens(engine, "left", refs["mlp4"]))
        failed = asyncio.create_task(_tokens(engine, "failed", refs["all16rs"]))
        await wait_for_async(
            lambda: engine.stats().num_waiting == 2, 30, "mlp4 and all16rs waiting", 0.001
        )
        assert {k: adapters.pool.wanted(k) for k in adapters.stats().wanted} == {
            refs["mlp4"].key: 1,
            refs["all16rs"].key: 1,
        }
        left.cancel()
        await engine.unload_adapter(refs["all16rs"].name)
        with pytest.raises((AdapterDraining, AdapterNotFound)):
            await failed
        with pytest.raises(asyncio.CancelledError):
            await left
        assert adapters.stats().wanted == ()
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
        assert adapters.stats().wanted == ()
    finally:
        engine.shutdown()
