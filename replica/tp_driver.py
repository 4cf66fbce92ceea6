"""The tensor-parallel driver: rank 0 of a replica, inside the engine's process.

The engine (scheduler, sampling, detokenizing, adapter manager) runs only here. The
driver starts one worker process per further rank (`replica.tp_worker`), and then:
- each step, before its own forward, broadcasts the step's inputs (`DriverRunner`),
  then gathers every rank's vocab shard of the step's logits;
- each adapter slot write / clear on its buffers is replayed on the workers' buffers
  (the SlotBuffers `on_change` hook), whatever thread the adapter manager runs it on;
  a write sends each worker only its shard of the adapter (one send per worker).
One lock orders those commands, so every rank sees the same sequence of collectives.
A command that fails or times out (a worker silent for tp_step_timeout_s) leaves the
ranks out of step: the driver marks the group broken, fails the step, and fails the
replica's health check from then on, so Serve replaces the replica.
`close` stops the workers (STOP, then a wait, then a kill), then shuts its side of the
group down; it also runs at interpreter exit, and a worker whose driver process died
exits by itself (tp_worker's watchdog).
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

import replica
from lora_core.base_shape import BaseShape
from lora_core.errors import ModelLoadFailed
from lora_core.weights import AdapterWeights
from replica.config import EngineConfig
from replica.engine_setup import TORCH_DTYPES, ModelShard
from replica.model_runner import ModelRunner, StepBatch, StepLogits
from replica.models.loader import read_config, resolve_model_dir
from replica.parallel import TPGroup, free_port
from replica.tp_protocol import CLEAR, STOP, WRITE, header, pack_shard, pack_step, slice_ranks
from replica.tp_worker import connect_and_build

log = logging.getLogger("lorafleet.tp_driver")
T = TypeVar("T")

# Rendezvous timeout: long enough for a worker process to start and import torch, short
# enough that a worker that never came up fails the engine's start instead of hanging it.
TIMEOUT_S = 120.0


class TPDriver:
    """Rank 0's side of the group: sends commands, owns the worker processes."""

    def __init__(
        self,
        group: TPGroup,
        procs: list[subprocess.Popen],
        device: torch.device,
        dtype: torch.dtype,
    ):
        """dtype: the slot buffers' (adapter values travel in it)."""
        self.group = group
        self.procs = procs
        self.device = device
        self.dtype = dtype
        self.lock = threading.Lock()
        self.closed = False
        self.broken: str | None = None
        """Why the group cannot be used any more (a command failed or timed out half way,
        so the ranks no longer agree on the next collective); None while it can."""

    def send_step(self, batch: StepBatch) -> None:
        """Broadcast one step's inputs (call with self.lock held, then run the forward)."""
        head, payload = pack_step(batch)
        self.group.broadcast(head)
        self.group.broadcast(payload)

    def slot_changed(self, base: BaseShape, slot: int, weights: AdapterWeights | None) -> None:
        """Replay a write (weights) or clear (None) of `slot` on every worker."""
        with self.lock:
            if self.closed:
                return
            self.check_usable()
            if weights is None:
                self.run_command(self.group.broadcast, header(CLEAR, slot, device=self.device))
                return
            size = self.group.size
            # Packed before the header: a bad adapter raises with no command half sent.
            shards = [
                pack_shard(weights, base, r, size, self.device, self.dtype) for r in range(1, size)
            ]
            numel = shards[0].numel()
            self.run_command(self._send_write, slot, numel, weights, base, shards)

    def _send_write(self, slot, numel, weights, base, shards) -> None:
        self.group.broadcast(header(WRITE, slot, numel, weights.rank, device=self.device))
        self.group.broadcast(slice_ranks(weights, base, self.device))
        for r, flat in enumerate(shards, start=1):
            self.group.send(flat, r)

    def run_command(self, fn: Callable[..., T], *args) -> T:
        """fn(*args), a command every rank follows (call with self.lock held). If it
        raises, the ranks no longer agree on the next collective: the group is marked
        broken, and every later command and health check fails."""
        try:
            return fn(*args)
        except BaseException as e:
            self.broken = f"{type(e).__name__}: {e}"
            log.error("tensor-parallel group broken (replica must be replaced): %s", e)
            raise

    def check_usable(self) -> None:
        """Raise RuntimeError when commands can no longer be sent (closed or broken)."""
        if self.closed:
            raise RuntimeError("the tensor-parallel workers were stopped (engine closed)")
        if self.broken is not None:
            raise RuntimeError(f"the tensor-parallel group is broken: {self.broken}")

    def check_alive(self) -> None:
        """Raise RuntimeError naming a worker that exited while the driver runs (its
        rank's collectives would fail every step from now on), or why the group broke
        (a worker that stopped answering within tp_step_timeout_s)."""
        if self.closed:
            return
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                raise RuntimeError(
                    f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with "
                    f"status {p.returncode}"
                )
        self.check_usable()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (killed at once when the group is broken); idempotent."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if self.broken is not None:
                timeout_s = 0.0
            else:
                try:
                    self.group.broadcast(header(STOP, device=self.device))
                except RuntimeError as e:  # a worker already gone: kill the rest below
                    log.warning("could not send STOP to the tensor-parallel workers: %s", e)
        _reap(self.procs, timeout_s)
        self.group.close()


class DriverRunner(ModelRunner):
    """The driver's ModelRunner: every step is preceded by its broadcast, and runs with
    the lock held from the broadcast to the last logits gather (a slot write between
    them would meet the workers in a gather)."""

    def __init__(self, runner: ModelRunner, driver: TPDriver):
        super().__init__(runner.model, runner.kv_caches, runner.block_size, runner.lora_ctx)
        self.driver = driver

    def execute(self, batch: StepBatch) -> StepLogits:
        with self.driver.lock:
            self.driver.check_usable()
            return self.driver.run_command(self._execute, batch)

    def _execute(self, batch: StepBatch) -> StepLogits:
        self.driver.send_step(batch)
        return super().execute(batch)


def _spawn(config: EngineConfig, device: torch.device, rank: int, port: int) -> subprocess.Popen:
    # The worker imports this package from where the driver did, whatever its cwd.
    root = str(Path(replica.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    cmd = [
        sys.executable,
        "-m",
        "replica.tp_worker",
        "--config",
        json.dumps(dataclasses.asdict(config)),
        "--rank",
        str(rank),
        "--port",
        str(port),
        "--device",
        str(device),
        "--timeout",
        str(TIMEOUT_S),
    ]
    return subprocess.Popen(cmd, env=env, cwd=root)


def _reap(procs: list[subprocess.Popen], grace_s: float) -> None:
    """Wait up to grace_s for each worker to exit, then kill it."""
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("tensor-parallel worker pid %d did not stop; killing it", p.pid)
            p.kill()
            p.wait()


def start_tensor_parallel(
    config: EngineConfig, device: torch.device
) -> tuple[ModelShard, Callable[[], None]]:
    """Start workers 1..tp-1, join them as rank 0, build rank 0's shard.

    -> (rank 0's shard, with a broadcasting runner and mirrored slot buffers; close()).
    Raises InvalidRequest before starting anything when the model cannot be split
    tensor_parallel_size ways, ModelLoadFailed (after stopping the workers) when any rank
    failed to build its shard.
    """
    read_config(resolve_model_dir(config.model)).check_tensor_parallel(config.tensor_parallel_size)
    port = free_port()
    procs = [_spawn(config, device, r, port) for r in range(1, config.tensor_parallel_size)]
    try:
        group, shard, error = connect_and_build(config, device, 0, port, TIMEOUT_S)
    except BaseException:
        _reap(procs, grace_s=0)
        raise
    if shard is None:
        _reap(procs, grace_s=30)  # they exit by themselves after the failed all-reduce
        group.close()
        if error is not None:
            raise error
        raise ModelLoadFailed(
            f"tensor-parallel start of {config.model}: a worker rank could not build its "
            "shard (its log says why)"
        )
    group.op_timeout = datetime.timedelta(seconds=config.tp_step_timeout_s)
    driver = TPDriver(group, procs, device, TORCH_DTYPES[config.dtype])
    base = shard.runner.model.config.base_shape
    shard.buffers.on_change = lambda slot, w: driver.slot_changed(base, slot, w)
    shard.runner = DriverRunner(shard.runner, driver)
    atexit.register(driver.close)
    return shard, driver.close
