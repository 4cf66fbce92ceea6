"""The engine reports queued requests' adapters to the CPU cache: a request waiting for
the slot keeps its adapter cached while newer adapters churn through, and every way out
of the queue (admitted, aborted, failed) lowers the count again."""

from __future__ import annotations

import shutil

import pytest

from lora_core.errors import (
    AdapterDraining,
    AdapterLoadFailed,
    AdapterNotFound,
    InvalidRequest,
)
from replica.offline import adapter_ref
from replica.sampling_params import SamplingParams
from tests.unit.replica.engines import small_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
IDS = [5, 6, 7, 8, 9]


def _drain(engine, outs: dict[str, list]) -> None:
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)


def test_waiting_requests_adapter_stays_cached_through_churn(llama_dir, refs):
    """qv8 runs in the only slot; "first" (mlp4) waits for it; then three more adapters'
    requests arrive and fill the 3-entry CPU cache in turn. Plain LRU dropped mlp4 at
    the first of them; now each newcomer displaces the previous one, and mlp4 goes
    from the CPU copy into the slot when qv8 is done (no disk read)."""
    engine = small_engine(llama_dir, max_loras=1, max_cpu_loras=3)
    pool = engine.adapters.pool
    engine.add_request("run", IDS, GREEDY, refs["qv8"])
    outs: dict[str, list] = {}
    for o in engine.step():
        outs.setdefault(o.request_id, []).append(o)
    engine.add_request("first", IDS, GREEDY, refs["mlp4"])
    for name in ("all16rs", "pattern", "regex12"):
        engine.add_request(name, IDS, GREEDY, refs[name])
        assert refs["mlp4"].key in pool.stats().cpu_keys
    assert pool.stats().wanted == tuple(
        refs[n].key for n in ("mlp4", "all16rs", "pattern", "regex12")
    )
    while "first" not in outs:
        before = pool.stats()
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    after = pool.stats()
    assert after.slots == (refs["mlp4"].key,)
    assert (after.loads_from_cpu, after.loads_from_disk) == (
        before.loads_from_cpu + 1,
        before.loads_from_disk,
    )
    _drain(engine, outs)
    assert all(o[-1].finish_reason == "length" for o in outs.values()) and len(outs) == 5
    assert pool.stats().wanted == ()


def test_admission_abort_and_failures_lower_the_count(llama_dir, llama_adapters, refs, tmp_path):
    """Requests leave the queue every way: admitted (m2, base), aborted (m1), failed at
    can_admit (all16rs unloaded) and failed at acquire (pattern's files gone while its
    CPU copy was dropped). Counts follow each, and nothing is left at the end."""
    shutil.copytree(llama_adapters["pattern"], tmp_path / "pattern")
    pattern = adapter_ref("pattern", tmp_path / "pattern", max_rank=16)
    mlp4, a16 = refs["mlp4"], refs["all16rs"]
    engine = small_engine(llama_dir, max_loras=1, max_cpu_loras=2)
    pool = engine.adapters.pool
    engine.add_request("run", IDS, GREEDY, refs["qv8"])
    outs: dict[str, list] = {}
    for o in engine.step():
        outs.setdefault(o.request_id, []).append(o)
    engine.add_request("p", IDS, GREEDY, pattern)
    engine.add_request("m1", IDS, GREEDY, mlp4)  # the CPU cache drops pattern for mlp4
    engine.add_request("m2", IDS, GREEDY, mlp4)
    engine.add_request("a", IDS, GREEDY, a16)
    engine.add_request("b", IDS, GREEDY, None)
    assert pattern.key not in pool.stats().cpu_keys
    wanted = {k: pool.wanted(k) for k in pool.stats().wanted}
    assert wanted == {pattern.key: 1, mlp4.key: 2, a16.key: 1}
    assert engine.abort("m1")
    assert pool.wanted(mlp4.key) == 1
    engine.adapters.unload(a16.name)
    shutil.rmtree(tmp_path / "pattern")
    for o in engine.step():  # "a" fails, "b" is admitted; the rest wait for the slot
        outs.setdefault(o.request_id, []).append(o)
    assert isinstance(outs["a"][-1].error, AdapterDraining | AdapterNotFound)
    assert pool.stats().wanted == (pattern.key, mlp4.key)
    _drain(engine, outs)
    assert isinstance(outs["p"][-1].error, AdapterLoadFailed)
    assert [outs[r][-1].finish_reason for r in ("run", "m1", "m2", "b")] == [
        "length",
        "abort",
        "length",
        "length",
    ]
    assert pool.stats().wanted == () and engine.stats().num_waiting == 0


def test_the_sync_path_wants_the_adapter_before_loading_it(llama_dir, refs):
    """add_request (offline, no async front) raises the want before it registers the
    adapter, so the manager's loader thread cannot drop the copy in between; a refusal
    after the load leaves no count."""
    engine = small_engine(llama_dir, max_loras=1, max_cpu_loras=2)
    pool, register = engine.adapters.pool, engine.adapters.register
    seen = []

    def spying(ref):
        seen.append(pool.wanted(ref.key))
        return register(ref)

    engine.adapters.register = spying
    engine.add_request("a", IDS, GREEDY, refs["mlp4"])
    assert seen == [1] and pool.wanted(refs["mlp4"].key) == 1  # one count, not two
    too_long = SamplingParams(max_tokens=10**6)
    with pytest.raises(InvalidRequest, match="maximum context length"):
        engine.add_request("b", IDS, too_long, refs["qv8"])  # refused after its want
    assert pool.wanted(refs["qv8"].key) == 0
    outs: dict[str, list] = {}
    _drain(engine, outs)
    assert pool.stats().wanted == ()
