"""Adapter slots under more active adapters than slots: a busy slot yields to an adapter
that waits for one (no starvation), and an adapter given a slot first runs the requests
queued for it by then, together (no one-request turns)."""

from __future__ import annotations

from replica.sampling_params import SamplingParams
from tests.tiny import run_requests
from tests.unit.replica.engines import small_engine


def test_busy_slots_yield_to_a_waiting_adapter(llama_dir, refs):
    """Two slots kept busy by a steady stream of requests of two adapters (a new request
    of each every other step, each running 8 steps) never had a moment with an idle
    slot, so a request of a third adapter waited forever. Now the least recently used
    busy adapter takes no new requests while another adapter waits for a slot: it
    drains, the waiting request gets its slot, and both busy adapters keep serving."""
    engine = small_engine(llama_dir)
    a, b, x = refs["qv8"], refs["mlp4"], refs["pattern"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    firsts: dict[str, int] = {}
    for step in range(60):
        if step % 2 == 0 and step < 50:
            for ref in (a, b):
                engine.add_request(f"{ref.name}-{step}", [5, 6, 7], params, ref)
        if step == 8:
            engine.add_request("x", [5, 6, 7], params, x)
        for o in engine.step():
            if o.new_token_ids:
                firsts.setdefault(o.request_id, step)
    assert "x" in firsts and firsts["x"] - 8 <= 12, firsts.get("x")
    assert max(firsts[f"{r.name}-48"] for r in (a, b)) - 48 <= 12
    while engine.has_unfinished():
        engine.step()
    assert engine.adapters.stats().wanted == ()


def test_an_adapter_given_a_slot_runs_its_queued_requests_together(llama_dir, refs):
    """One slot, 6 queued requests of each of two adapters: the adapter that gets the slot
    admits all its requests queued by then in one batch, then yields to the other (2 slot
    loads). Before, the adapter yielded after its first request, so each slot load ran one
    request (12 loads, batch size 1) and tokens equal to the requests run alone."""
    engine = small_engine(llama_dir, max_loras=1)
    a, b = refs["qv8"], refs["mlp4"]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    reqs = [(f"{r.name}-{i}", f"the {i} fox", params, r) for i in range(6) for r in (a, b)]
    alone = {
        rid: run_requests(small_engine(llama_dir), [(rid, p, s, r)])[rid] for rid, p, s, r in reqs
    }
    got = run_requests(engine, reqs)
    assert got == alone
    assert engine.adapters.stats().slot_loads == 2
