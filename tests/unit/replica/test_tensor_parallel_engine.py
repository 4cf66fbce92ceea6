"""Tensor parallelism at the engine level: an engine with tensor_parallel_size=2 on CPU
(the engine's process is rank 0, one gloo worker process) generates the greedy tokens of
the tp=1 engine (itself equal to HF + PEFT, test_generate_vs_peft) for base and several
adapters in one run, with fewer slots than adapters so slot writes and clears reach the
worker, also with an odd (padded) vocabulary; its sampler, penalties, logit_bias and
logprobs see the tp=1 logits (gathered from both ranks' vocab shards); close() stops the
worker, and a worker whose driver is killed exits by itself."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lora_core.errors import InvalidRequest, ModelLoadFailed
from replica.config import EngineConfig
from replica.sampling_params import SamplingParams
from tests.polling import wait_for
from tests.tiny import run_requests
from tests.unit.replica.engines import small_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = ["hello world how are you", "the quick brown fox jumps over"]
ADAPTERS = ("all16rs", "qv8", "mlp4")  # three adapters, two slots


def _requests(refs):
    return [
        (f"{name or 'base'}-{i}", prompt, GREEDY, refs[name] if name else None)
        for i, prompt in enumerate(PROMPTS)
        for name in (None, *ADAPTERS)
    ]


@pytest.mark.parametrize("model", ["llama", "odd_vocab"])  # the llama adapters fit both
def test_tp2_engine_equals_tp1(model, refs, request):
    model_dir = request.getfixturevalue(f"{model}_dir")
    want = run_requests(small_engine(model_dir), _requests(refs))
    engine = small_engine(model_dir, tensor_parallel_size=2)
    procs = engine.runner.driver.procs
    try:
        got = run_requests(engine, _requests(refs))
        assert engine.stats().adapter_loads > 2  # slots were rewritten on both ranks
        engine.check_health()
    finally:
        engine.close()
    assert got == want
    assert [p.returncode for p in procs] == [0]


# Every reader of the logits, on ids of both ranks' shards: 382 is V - 1, the last real
# row of rank 1's (padded) shard; 0 and 191 end rank 0's.
LAST = 382
READERS = (
    SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((0, 3.0), (191, 2.5), (LAST, 9.0))),
    SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.8, presence_penalty=0.7),
    SamplingParams(max_tokens=8, temperature=0.9, top_k=40, top_p=0.9, seed=7, logprobs=True),
    SamplingParams(
        max_tokens=8, temperature=1.0, frequency_penalty=0.5, seed=3, logprobs=True, top_logprobs=3
    ),
    SamplingParams(max_tokens=4, temperature=0.0, min_tokens=4, stop_token_ids=(LAST,)),
    SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=4, logprobs=True),
)


def _outputs(engine, refs) -> dict[str, list]:
    for i, params in enumerate(READERS):
        for name in (None, "qv8"):
            ids = engine.tokenizer(PROMPTS[i % 2]).input_ids
            engine.add_request(f"{i}-{name}", ids, params, refs[name] if name else None)
    got: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            got.setdefault(o.request_id, []).append(
                (o.new_token_ids, o.new_logprobs, o.new_top_logprobs, o.prompt_logprobs)
            )
    return got


def test_tp2_logit_readers_see_the_tp1_logits(odd_vocab_dir, refs):
    want = _outputs(small_engine(odd_vocab_dir), refs)
    engine = small_engine(odd_vocab_dir, tensor_parallel_size=2)
    try:
        got = _outputs(engine, refs)
    finally:
        engine.close()
    assert [o[0] for o in want["0-None"]][0][0] == LAST  # the bias picked rank 1's last id
    assert got.keys() == want.keys()
    for rid, outs in want.items():
        assert [o[0] for o in got[rid]] == [o[0] for o in outs], rid
        for g, w in zip(got[rid], outs, strict=True):
            assert g[1] == pytest.approx(w[1], abs=1e-4)
            assert [[t for t, _ in row] for row in g[2]] == [[t for t, _ in row] for row in w[2]]
            assert (g[3] is None) == (w[3] is None)
            assert g[3] is None or g[3] == pytest.approx(w[3], abs=1e-4)


def test_tp2_structured_outputs_equal_tp1(odd_vocab_dir, refs):
    """The driver masks the gathered logits: with logits of another width than the
    tokenizer's vocabulary (the odd_vocab model: 383 logits, 384 tokens; its last rank's
    shard padded), every structured kind gives tp=1's tokens, with an adapter."""
    from tests.unit.replica.test_structured_vs_hf import SPECS

    reqs = [
        (kind, f"hello world {i}", SamplingParams(max_tokens=12, temperature=0.0,
                                                  structured_outputs=spec),
         refs["qv8"] if i % 2 else None)
        for i, (kind, spec) in enumerate(SPECS.items())
    ]  # fmt: skip
    want = run_requests(small_engine(odd_vocab_dir), reqs)
    engine = small_engine(odd_vocab_dir, tensor_parallel_size=2)
    try:
        assert run_requests(engine, reqs) == want
    finally:
        engine.close()


def test_a_dead_worker_fails_the_health_check(llama_dir):
    engine = small_engine(llama_dir, tensor_parallel_size=2)
    try:
        worker = engine.runner.driver.procs[0]
        worker.kill()
        worker.wait()
        with pytest.raises(RuntimeError, match="worker rank 1 .* exited"):
            engine.check_health()
    finally:
        engine.close()


def test_a_stopped_worker_fails_the_step_and_the_health_check(llama_dir):
    """A worker that stops answering (SIGSTOP) fails the step within tp_step_timeout_s
    instead of hanging the replica; the group is broken from then on (health check and
    later steps fail), and close() kills the worker at once."""
    engine = small_engine(llama_dir, tensor_parallel_size=2, tp_step_timeout_s=2)
    worker = engine.runner.driver.procs[0]
    try:
        engine.check_health()
        os.kill(worker.pid, signal.SIGSTOP)
        engine.add_request("r0", [5, 6, 7], GREEDY)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="[Tt]imed out"):
            engine.step()
        assert time.monotonic() - start < 20
        with pytest.raises(RuntimeError, match="group is broken: .*[Tt]imed out"):
            engine.check_health()
        engine.add_request("r1", [8, 9], GREEDY)
        with pytest.raises(RuntimeError, match="group is broken"):
            engine.step()
    finally:
        start = time.monotonic()
        engine.close()
        closed_in = time.monotonic() - start
    assert closed_in < 5
    assert worker.returncode == -signal.SIGKILL


def test_tensor_parallel_size_validated(llama_dir):
    with pytest.raises(InvalidRequest, match="tensor_parallel_size=0; allowed"):
        EngineConfig(model=str(llama_dir), tensor_parallel_size=0)
    for timeout in (0, -1.0, float("inf"), float("nan"), "5", True):
        with pytest.raises(InvalidRequest, match="tp_step_timeout_s=.*; allowed: a finite"):
            EngineConfig(model=str(llama_dir), tp_step_timeout_s=timeout)
    # refused before any worker starts: the tiny model has 4 heads, 2 kv heads
    with pytest.raises(InvalidRequest, match="num_attention_heads=4 is not divisible by"):
        small_engine(llama_dir, tensor_parallel_size=3)
    with pytest.raises(InvalidRequest, match="num_key_value_heads=2 is not divisible by"):
        small_engine(llama_dir, tensor_parallel_size=4)


def _workers_of(model_dir: Path) -> list[int]:
    """pids of live tensor-parallel workers started for model_dir."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "replica.tp_worker" in cmd and str(model_dir) in cmd and _alive(int(proc.name)):
            pids.append(int(proc.name))
    return pids


def test_failed_shard_load_stops_workers(llama_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    weights.write_bytes(data[: header_end + 100])  # header intact, tensors cut off
    with pytest.raises(ModelLoadFailed, match="model.safetensors"):
        small_engine(broken, tensor_parallel_size=2)
    assert _workers_of(broken) == []


_DRIVER = """
import sys, time
from tests.unit.replica.engines import small_engine
engine = small_engine(sys.argv[1], tensor_parallel_size=2)
print(*[p.pid for p in engine.runner.driver.procs], flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def test_worker_exits_when_driver_killed(llama_dir):
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, str(llama_dir)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=root,
    )
    try:
        pid = int(driver.stdout.readline())
        assert _alive(pid)
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        wait_for(lambda: not _alive(pid), 20, f"worker {pid} exiting after its driver", 0.2)
    finally:
        driver.kill()
