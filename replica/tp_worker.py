"""A tensor-parallel worker: rank r >= 1 of one replica's TP group, in its own process.

Started by the driver (`replica.tp_driver`) as `python -m replica.tp_worker` with the
engine config as JSON on the command line (no pickles cross the process boundary). It
joins the group, builds its model shard, reports whether that worked (one all-reduce
of a failure flag, so every rank learns of any rank's failure), then follows the
driver's commands (`replica.tp_protocol`) until STOP, or until the driver is gone: a
broken connection fails the next collective, and a watchdog thread exits the process
when its parent changes (the driver was killed), so no worker outlives its engine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time

import torch

from lora_core.slot_buffers import SlotBuffers
from replica.config import EngineConfig
from replica.engine_setup import ModelShard, build_shard
from replica.parallel import TPGroup
from replica.tp_protocol import (
    CLEAR,
    HEADER_LEN,
    STEP,
    STOP,
    WRITE,
    num_slices,
    step_payload_len,
    unpack_shard,
    unpack_step,
)

log = logging.getLogger("lorafleet.tp_worker")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def worker_device(driver_device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the driver's CUDA index + r, or the CPU."""
    if driver_device.type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", (driver_device.index or 0) + rank)


def connect_and_build(
    config: EngineConfig, device: torch.device, rank: int, port: int, timeout_s: float
) -> tuple[TPGroup, ModelShard | None, Exception | None]:
    """Join the group and build this rank's shard -> (group, shard, this rank's error).

    shard is None on every rank when any rank failed (one all-reduce of a failure flag
    tells them all); error is what this rank's build raised, or None."""
    group = TPGroup.connect(rank, config.tensor_parallel_size, port, backend_for(device), timeout_s)
    shard, error = None, None
    try:
        shard = build_shard(config, device, group)
    except Exception as e:  # noqa: BLE001 - every rank must reach the all-reduce below
        error = e
    failed = torch.tensor([error is not None], dtype=torch.long, device=device)
    if int(group.all_reduce(failed).item()):
        shard = None
    return group, shard, error


def serve(group: TPGroup, shard: ModelShard, device: torch.device) -> None:
    """Follow the driver's commands until STOP."""
    head = torch.zeros(HEADER_LEN, dtype=torch.long, device=device)
    while True:
        h = group.broadcast(head).tolist()
        kind = h[0]
        if kind == STEP:
            payload = torch.empty(step_payload_len(h), dtype=torch.long, device=device)
            step = unpack_step(h, group.broadcast(payload), shard.runner.dense_prompt_min)
            shard.runner.follow(step)
        elif kind in (WRITE, CLEAR):
            apply_slot_command(group, shard.buffers, h)
        elif kind == STOP:
            return
        else:
            raise RuntimeError(f"unknown command {kind} from the driver")


def apply_slot_command(group: TPGroup, buffers: SlotBuffers, h: list[int]) -> None:
    """Receive the rest of a WRITE (slice ranks, then this rank's shard of the values)
    or a CLEAR whose header h came, and apply it to this rank's buffers."""
    if h[0] == CLEAR:
        buffers.clear(h[1])
        return
    slot, numel, rank = h[1:4]
    ranks = torch.empty(num_slices(buffers.base), dtype=torch.long, device=buffers.device)
    group.broadcast(ranks)
    flat = group.recv(torch.empty(numel, dtype=buffers.dtype, device=buffers.device))
    buffers.write_shard(slot, unpack_shard(ranks, flat, buffers.base, rank, group.size))


def _watch_parent(parent_pid: int) -> None:
    """Exit this process as soon as its parent (the driver) is gone."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", required=True, help="EngineConfig fields as JSON")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--device", required=True, help="the driver's device")
    ap.add_argument("--timeout", type=float, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"tp rank {args.rank}: %(message)s")
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    config = EngineConfig(**json.loads(args.config))
    device = worker_device(torch.device(args.device), args.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group, shard, error = connect_and_build(config, device, args.rank, args.port, args.timeout)
    try:
        if shard is None:
            if error is not None:
                log.error("could not build this rank's shard: %s", error)
            return 1
        with torch.inference_mode():
            serve(group, shard, device)
        return 0
    finally:
        group.close()


if __name__ == "__main__":
    sys.exit(main())
