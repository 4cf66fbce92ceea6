"""Seeded randomized stress of one engine on a tiny model: random prompt lengths (one
token, block boundaries, up to max_model_len), shared prefixes, greedy / seeded / stop
requests over five adapters with two slots and a three-adapter CPU cache, a KV cache so
small that preemption is constant, a token budget that splits prompts at odd points,
aborts, and adapters unloaded and re-registered (new version, new weights) mid-run.

Checks: every request that was neither aborted nor refused gives the tokens and text of
the same request run alone on a roomy engine; a request waiting for an unloaded adapter
fails alone, one already admitted finishes; nothing is stuck; afterwards no KV block or
slot is referenced, and unloading every adapter frees its CPU copy and zeroes its slot.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import pytest
import torch

from lora_core.errors import AdapterDraining, AdapterNotFound
from replica.engine import LLMEngine
from replica.offline import adapter_ref
from replica.sampling_params import SamplingParams
from tests.tiny import ADAPTER_SPECS, make_peft_adapter
from tests.unit.replica.engines import small_engine

MAX_LEN = 48
NAMES = list(ADAPTER_SPECS)
GONE = (AdapterDraining, AdapterNotFound)


@pytest.fixture(scope="module")
def versions(llama_dir, llama_adapters, tmp_path_factory):
    """Two weight sets per adapter name: {name: (refs of version 1 dir, version 2 dir)}."""
    root = tmp_path_factory.mktemp("v2")
    out = {}
    for i, (name, spec) in enumerate(ADAPTER_SPECS.items()):
        v2 = make_peft_adapter(llama_dir, root / name, seed=100 + i, **spec)
        out[name] = (
            adapter_ref(name, llama_adapters[name], max_rank=16, version=1),
            adapter_ref(name, v2, max_rank=16, version=2),
        )
    return out


def _engine(model_dir, **kw) -> LLMEngine:
    return small_engine(model_dir, **{"max_cpu_loras": 3, "max_model_len": MAX_LEN, **kw})


def _requests(rng: random.Random, n: int) -> list[tuple[str, list[int], SamplingParams, str]]:
    shared = [rng.randrange(1, 384) for _ in range(40)]
    out = []
    for i in range(n):
        length = rng.choice([1, 3, 4, 5, 8, 12, 16, 17, 30, 40])
        cut = min(length, rng.choice([0, 4, 6, 8, 12, 16]))  # shared prefix, full or partial
        prompt = shared[:cut] + [rng.randrange(1, 384) for _ in range(length - cut)]
        mt, kind = rng.randint(1, MAX_LEN - length), rng.random()
        if kind < 0.2:
            sp = SamplingParams(
                max_tokens=mt, top_p=0.9, top_k=rng.choice([0, 20]), seed=rng.randrange(1000)
            )
        elif kind < 0.35:
            stop = (chr(rng.randrange(97, 123)),)
            sp = SamplingParams(max_tokens=mt, temperature=0.0, stop=stop,
                                stop_token_ids=(rng.randrange(384),))  # fmt: skip
        else:
            sp = SamplingParams(max_tokens=mt, temperature=0.0, ignore_eos=rng.random() < 0.7)
        out.append((f"r{i}", prompt, sp, rng.choice(["", *NAMES])))
    return out


@dataclass
class _Run:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    text: dict[str, str] = field(default_factory=dict)
    final: dict[str, object] = field(default_factory=dict)
    ref_of: dict[str, object] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    refused: set[str] = field(default_factory=set)
    must_fail: set[str] = field(default_factory=set)


def _unload(engine: LLMEngine, name: str, run: _Run) -> None:
    """Unload name; its admitted requests must finish, its waiting ones fail."""
    for rid, seq in engine._seqs.items():
        if seq.adapter is not None and seq.adapter.name == name and not seq.holds_slot:
            run.must_fail.add(rid)
    engine.adapters.unload(name)


def _stress(engine: LLMEngine, reqs, versions, rng: random.Random) -> _Run:
    run = _Run()
    current = {n: versions[n][0] for n in NAMES}
    pending = list(reqs)
    for _ in range(3000):
        if not pending and not engine.has_unfinished():
            return run
        for rid, prompt, sp, name in pending[: rng.choice([0, 0, 0, 1, 2])]:
            run.tokens[rid], run.text[rid] = [], ""
            run.ref_of[rid] = current[name] if name else None
            try:
                engine.add_request(rid, prompt, sp, run.ref_of[rid])
            except GONE:
                run.refused.add(rid)
            pending.remove((rid, prompt, sp, name))
        roll = rng.random()
        if roll < 0.03 and engine._seqs:
            rid = rng.choice(sorted(engine._seqs))
            engine.abort(rid)
            run.aborted.add(rid)
        elif roll < 0.06:
            name = rng.choice(NAMES)
            if current[name].key in engine.adapters.pool:
                _unload(engine, name, run)
                v1, v2 = versions[name]
                # re-registered under the same name: new weights or old, a new version
                nxt = v2 if current[name].path == v1.path else v1
                current[name] = replace(nxt, version=current[name].version + 2)
        for o in engine.step():
            run.tokens[o.request_id] += o.new_token_ids
            run.text[o.request_id] += o.new_text
            if o.finished:
                run.final[o.request_id] = (o.finish_reason, o.error)
    raise AssertionError(f"requests stuck: {sorted(engine._seqs)}")


@pytest.mark.parametrize("seed", [8, 15])
def test_random_traffic_equals_each_request_alone(llama_dir, versions, seed):
    rng = random.Random(seed)
    reqs = _requests(rng, 30)
    engine = _engine(llama_dir, num_kv_blocks=13, max_num_batched_tokens=7, max_num_seqs=5)
    run = _stress(engine, reqs, versions, rng)
    assert engine.scheduler.num_preemptions > 5 and engine.blocks.prefix_hit_tokens > 0
    served = {rid for rid in run.final if rid not in run.aborted | run.must_fail}
    # the run hit every path: unloads under waiting requests, re-registered versions served
    assert run.must_fail and any(getattr(run.ref_of[r], "version", 0) > 2 for r in served)
    alone = _engine(llama_dir, enable_prefix_caching=False, max_loras=5, max_cpu_loras=5)
    for rid, prompt, sp, _ in reqs:
        if rid in run.aborted or rid in run.refused:
            continue
        if rid in run.must_fail:
            assert run.tokens[rid] == [] and run.final[rid][0] == "error", rid
            assert isinstance(run.final[rid][1], GONE)
            continue
        alone.add_request(rid, prompt, sp, run.ref_of[rid])
        tokens, text = [], ""
        while alone.has_unfinished():
            for o in alone.step():
                tokens, text = tokens + o.new_token_ids, text + o.new_text
        assert (run.tokens[rid], run.text[rid]) == (tokens, text), rid
        assert run.final[rid][1] is None, rid
    _assert_all_released(engine)


def _assert_all_released(engine: LLMEngine) -> None:
    blocks, pool = engine.blocks, engine.adapters.pool
    assert all(blocks.ref_count(b) == 0 for b in range(blocks.num_blocks))
    assert blocks.num_free == blocks.num_blocks
    assert all(pool.refcount(k) == 0 for k in pool._entries)
    for name in {key.split("@")[0] for key in pool._entries}:
        engine.adapters.unload(name)
    stats = engine.stats()
    assert stats.free_slots == 2 and stats.cpu_adapters == () and stats.gpu_adapters == ()
    assert engine.adapters.cpu_nbytes == 0 and not engine.adapters._manifests
    buffers = engine.adapters.buffers
    assert not buffers.slot_ranks.any()
    for layer in range(buffers.base.num_layers):
        for group in ("qkv", "o", "gate_up", "down"):
            for t in buffers.a(layer, group) + buffers.b(layer, group):
                assert not torch.count_nonzero(t), (layer, group)
