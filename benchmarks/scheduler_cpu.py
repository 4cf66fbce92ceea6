"""Scheduler step cost on CPU against queue length: the per-adapter waiting queue vs the
old full scan of the queue, both timed in the same run; and adapter slot turns.

Each figure is printed beside its peer: the old algorithm (tests/unit/replica/
scan_scheduler.py: one deque scanned from its head every step, one can_admit per
request whose adapter has no slot) on the same workload, and the step's can_admit calls
("looks", a machine-independent measure of the waiting-side work). Both schedulers use
the real BlockManager and the real SlotPool (lora_core/pool.py) behind a thin
AdapterAdmission; no model runs (a step appends one token to each finished prompt).
The new scheduler also reports queued demand to the pool (want / unwant), as the
engine's does; the old one made no such calls.

Workloads, each at 1k / 10k / 50k queued requests (--sizes):
  blocked     4 GPU slots held by 4 long-running requests of adapters a0-a3; the queue
              holds N requests of adapters a4-a7 (no slot for them); each step 2 new
              requests (base, and a0-a3: admissible) arrive at the tail and run one step.
              The old scan walks the N blocked requests every step to reach them.
  admissible  8 adapters in 8 slots, 64 running; each step the 4 oldest finish and 4
              arrive: the old scan stops after 4 admissions too (the common case; this
              row shows the new structure's overhead).
  offline     N requests (16-token prompts, 8 output tokens) over 256 adapters, round
              robin, with the engine's defaults (4 slots, 64 sequences, 2048 tokens):
              the whole run to the end, as `lorafleet generate` queues it; total
              schedule() time, and the two schedulers' decisions are checked equal.
All workloads use 64 sequences and 2048 tokens per step (EngineConfig's defaults). These
three drive the pool without slot turns (`SlotPool.yields_slot`), as the old scheduler
ran: with turns the busy adapters of "blocked" would yield their slots to a4-a7.

Slot turns (no timing: the schedule's decisions, which are deterministic), with yields_slot
on (as the engine's adapter manager checks it) and off:
  turns       2 GPU slots, A adapters (--turn-adapters, 3-8), 2 requests a step arriving in
              round robin over them for --turn-steps steps (16-token prompts, 8 tokens
              each: a request runs 8 steps), then to the end. An adapter in a slot has a
              running request at every step, so with turns off the first two keep their
              slots and the others wait until the traffic stops. Per A, both ways: slot
              loads per 100 requests (floor: each adapter loaded once), the mean batch
              (sequences per step while requests arrive; ceiling: arrivals per step x
              steps per request, Little's law), the longest wait of a request from arrival
              to its first step (the starved adapter's) and the steps to the end.

    python benchmarks/scheduler_cpu.py --out benchmarks/results/scheduler_cpu.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run_info import write_results  # noqa: E402
from lora_core.identity import AdapterRef  # noqa: E402
from lora_core.pool import SlotPool  # noqa: E402
from replica.block_manager import BlockManager  # noqa: E402
from replica.sampling_params import SamplingParams  # noqa: E402
from replica.scheduler import Scheduler  # noqa: E402
from replica.sequence import Sequence, Status  # noqa: E402
from tests.unit.replica.scan_scheduler import ScanScheduler  # noqa: E402

REFS = [AdapterRef(f"a{i}", 1, f"{i:064x}", "/bench", 16) for i in range(256)]


class PoolAdmission:
    """AdapterAdmission + AdapterDemand over the real SlotPool (its actions are dropped:
    no weights move); counts can_admit calls. yields: also keep out the new requests of an
    adapter whose slot yields to a waiting one, as the engine's adapter manager does
    (`AdapterManager.can_admit`)."""

    def __init__(self, max_loras: int, refs: list[AdapterRef], yields: bool = False):
        self.pool = SlotPool(max_loras, max(max_loras, len(refs)))
        for ref in refs:
            self.pool.add(ref.key, ref.name)
        self.yields = yields
        self.looks = 0

    def can_admit(self, ref: AdapterRef) -> bool:
        self.looks += 1
        if not self.pool.can_admit(ref.key):
            return False
        return not (self.yields and self.pool.yields_slot(ref.key))

    def acquire(self, ref: AdapterRef) -> int:
        return self.pool.acquire(ref.key)[0]

    def release(self, ref: AdapterRef) -> None:
        self.pool.release(ref.key)

    def want(self, ref: AdapterRef) -> None:
        self.pool.want(ref.key)

    def unwant(self, ref: AdapterRef) -> None:
        self.pool.unwant(ref.key)


def make(cls, slots: int, refs, yields: bool = False) -> Scheduler:
    admission = PoolAdmission(slots, refs, yields)
    blocks = BlockManager(1 << 16, 16, False)
    if cls is Scheduler:
        return Scheduler(blocks, admission, 64, 2048, demand=admission)
    return cls(blocks, admission, 64, 2048)


class Feed:
    """Requests with increasing ids (arrival order)."""

    def __init__(self) -> None:
        self.n = 0

    def seq(self, adapter, prompt_len: int = 16, max_tokens: int = 8) -> Sequence:
        self.n += 1
        params = SamplingParams(max_tokens=max_tokens)
        tokens = [(self.n + i) % 1000 for i in range(prompt_len)]
        return Sequence(str(self.n), prompt_len, tokens, params, adapter, self.n)


def advance(s: Scheduler, out) -> list[Sequence]:
    """The model's part of a step; returns the sequences that finished."""
    s.after_step(out)
    done = []
    for seq, _ in out.scheduled:
        if seq.remaining == 0:
            seq.tokens.append(seq.arrival % 7)
            if seq.num_output >= seq.params.max_tokens:
                s.finish(seq, "length")
                done.append(seq)
    return done


def timed(s: Scheduler):
    t0 = time.perf_counter()
    out = s.schedule()
    return out, time.perf_counter() - t0


def blocked(cls, n: int, steps: int) -> dict:
    s, feed = make(cls, 4, REFS[:8]), Feed()
    for ref in REFS[:4]:
        s.add(feed.seq(ref, max_tokens=10**9))
    advance(s, s.schedule())
    for i in range(n):
        s.add(feed.seq(REFS[4 + i % 4]))
    times, looks = [], []
    for step in range(steps):
        arrivals = [feed.seq(None), feed.seq(REFS[step % 4])]
        for seq in arrivals:
            s.add(seq)
        s.adapters.looks = 0
        out, dt = timed(s)
        assert all(seq.status is Status.RUNNING for seq in arrivals), "arrivals not admitted"
        advance(s, out)
        for seq in arrivals:
            s.finish(seq, "stop")
        times.append(dt)
        looks.append(s.adapters.looks)
    assert len(s.waiting) == n
    return {"ms_per_step": 1e3 * statistics.median(times), "looks_per_step": max(looks)}


def admissible(cls, n: int, steps: int) -> dict:
    s, feed = make(cls, 8, REFS[:8]), Feed()
    for i in range(n + 64):
        s.add(feed.seq(REFS[i % 8], max_tokens=10**9))
    advance(s, s.schedule())
    times, looks = [], []
    for step in range(steps):
        for seq in s.running[:4]:
            s.finish(seq, "stop")
        for i in range(4):
            s.add(feed.seq(REFS[(step + i) % 8], max_tokens=10**9))
        s.adapters.looks = 0
        out, dt = timed(s)
        advance(s, out)
        times.append(dt)
        looks.append(s.adapters.looks)
    assert len(s.waiting) == n and len(s.running) == 64
    return {"ms_per_step": 1e3 * statistics.median(times), "looks_per_step": max(looks)}


def offline(cls, n: int) -> dict:
    s, feed = make(cls, 4, REFS), Feed()
    for i in range(n):
        s.add(feed.seq(REFS[i % len(REFS)]))
    total, steps, looks, decisions, finished = 0.0, 0, 0, [], 0
    while s.has_work():
        s.adapters.looks = 0
        out, dt = timed(s)
        total += dt
        steps += 1
        looks += s.adapters.looks
        decisions.append(hash(tuple((seq.arrival, k) for seq, k in out.scheduled)))
        finished += len(advance(s, out))
    assert finished == n
    return {
        "schedule_s": total,
        "steps": steps,
        "ms_per_step": 1e3 * total / steps,
        "looks_per_step": looks / steps,
        "decisions": hash(tuple(decisions)),
    }


TURN_RATE = 2  # requests arriving per step
TURN_TOKENS = 8  # tokens per request: steps it runs (its 16-token prompt fits one step)


def turns(adapters: int, yields: bool, steps: int) -> dict:
    """The slot-turn workload (module docstring) with yields_slot on or off."""
    refs = REFS[:adapters]
    s, feed = make(Scheduler, 2, refs, yields), Feed()
    arrived: dict[Sequence, int] = {}
    started: dict[Sequence, int] = {}
    batches = []
    step = 0
    while step < steps or s.has_work():
        if step < steps:
            for _ in range(TURN_RATE):
                seq = feed.seq(refs[len(arrived) % adapters], max_tokens=TURN_TOKENS)
                arrived[seq] = step
                s.add(seq)
        out = s.schedule()
        for seq, _ in out.scheduled:
            started.setdefault(seq, step)
        if step < steps:
            batches.append(len(out.scheduled))
        advance(s, out)
        step += 1
    waits: dict[str, int] = {}
    for seq, at in arrived.items():
        waits[seq.adapter.name] = max(waits.get(seq.adapter.name, 0), started[seq] - at)
    assert not s.running and not s.waiting and s.adapters.pool.stats().wanted == ()
    return {
        "requests": len(arrived),
        "slot_loads": s.adapters.pool.stats().slot_loads,
        "slot_loads_per_100_requests": 100 * s.adapters.pool.stats().slot_loads / len(arrived),
        "mean_batch": statistics.mean(batches),
        "max_wait_steps": max(waits.values()),
        "max_wait_steps_by_adapter": waits,
        "steps": step,
    }


def measure_turns(adapters: int, steps: int) -> dict:
    on, off = turns(adapters, True, steps), turns(adapters, False, steps)
    return {
        "adapters": adapters,
        "slots": 2,
        "on": on,
        "off": off,
        "floor_slot_loads_per_100_requests": 100 * adapters / on["requests"],
        "ceiling_mean_batch": TURN_RATE * TURN_TOKENS,
    }


TURN_HEAD = f"{'adapters':>8}  {'loads / 100 requests':<22}{'mean batch':<22}{'max wait':<16}steps"


def show_turns(row: dict) -> None:
    on, off = row["on"], row["off"]
    key = "slot_loads_per_100_requests"
    loads = f"{on[key]:.2f} ({off[key]:.2f}; {row['floor_' + key]:.2f})"
    batch = f"{on['mean_batch']:.2f} ({off['mean_batch']:.2f}; {row['ceiling_mean_batch']})"
    wait = f"{on['max_wait_steps']} ({off['max_wait_steps']})"
    print(f"{row['adapters']:>8}  {loads:<22}{batch:<22}{wait:<16}{on['steps']} ({off['steps']})")


def measure(name: str, n: int, steps: int) -> dict:
    """One row: the workload at n queued requests under both schedulers."""
    if name == "offline":
        new, old = offline(Scheduler, n), offline(ScanScheduler, n)
        assert old.pop("decisions") == new.pop("decisions"), "the schedulers disagree"
    else:
        fn = blocked if name == "blocked" else admissible
        new, old = fn(Scheduler, n, steps), fn(ScanScheduler, n, steps)
    ratio = old["ms_per_step"] / new["ms_per_step"]
    return {"workload": name, "queued": n, "new": new, "old": old, "old_over_new": ratio}


def show(row: dict) -> None:
    new, old = row["new"], row["old"]
    line = f"{row['workload']:<11} {row['queued']:>7} {new['ms_per_step']:>12.4f}"
    line += f" {old['ms_per_step']:>12.4f} {row['old_over_new']:>7.1f}x"
    line += f" {new['looks_per_step']:>10.2f} {old['looks_per_step']:>10.2f}"
    if row["workload"] == "offline":
        line += f"   run: {new['steps']} steps, schedule() new {new['schedule_s']:.2f} s"
        line += f", old {old['schedule_s']:.2f} s, same decisions"
    print(line, flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 50_000])
    p.add_argument("--steps", type=int, default=40, help="timed steps per per-step figure")
    p.add_argument("--turn-adapters", type=int, nargs="+", default=[3, 4, 5, 6, 7, 8])
    p.add_argument("--turn-steps", type=int, default=400, help="steps of arrivals (turns)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    load_at_start = round(os.getloadavg()[0], 2)
    rows, growth = [], {}
    head = f"{'workload':<11} {'queued':>7} {'new ms/step':>12} {'old ms/step':>12} {'old/new':>8}"
    print(head + f" {'new looks':>10} {'old looks':>10}")
    for name in ("blocked", "admissible", "offline"):
        mine = [measure(name, n, args.steps) for n in args.sizes]
        for row in mine:
            show(row)
        first, last = mine[0], mine[-1]
        growth[name] = {k: last[k]["ms_per_step"] / first[k]["ms_per_step"] for k in ("new", "old")}
        print(
            f"{'':<11} ms/step at {last['queued']} queued over {first['queued']}: "
            f"new {growth[name]['new']:.2f}x, old {growth[name]['old']:.2f}x"
        )
        rows += mine
    print(
        f"\nslot turns: 2 slots, {TURN_RATE} requests a step in round robin over the adapters "
        f"for {args.turn_steps} steps, {TURN_TOKENS} tokens each; yields_slot on (off; "
        "floor / ceiling)"
    )
    print(TURN_HEAD)
    turn_rows = [measure_turns(a, args.turn_steps) for a in args.turn_adapters]
    for row in turn_rows:
        show_turns(row)
    if args.out:
        write_results(
            args,
            load_at_start,
            {
                "notes": "ms_per_step: median schedule() time over --steps steps (offline: mean over "
                "the run); looks_per_step: can_admit calls per step (max; offline: mean); old: the "
                "full-scan scheduler before the per-adapter queue, on the same workload; new also "
                "reports queued demand to the pool (want / unwant), as the engine's does",
                "results": rows,
                "ms_per_step_growth_largest_over_smallest": growth,
                "slot_turns": {
                    "notes": "2 slots, A adapters, TURN_RATE requests a step in round robin over "
                    "them for --turn-steps steps (16-token prompts, TURN_TOKENS tokens each), "
                    "then to the end; on / off: SlotPool.yields_slot checked at admission (the "
                    "engine's) or not; slot_loads_per_100_requests (floor: each adapter once); "
                    "mean_batch: sequences per step while requests arrive (ceiling: "
                    "TURN_RATE x TURN_TOKENS, Little's law); max_wait_steps: the longest a "
                    "request waited from arrival to its first step; steps: to the end",
                    "turn_rate": TURN_RATE,
                    "turn_tokens": TURN_TOKENS,
                    "results": turn_rows,
                },
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
