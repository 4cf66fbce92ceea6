"""Tensor-parallel slot writes: the driver (rank 0) sends each worker only its shard of an
adapter, so the values a worker receives for a slot write are exactly its shard's
(`pack_shard` for its rank, about 1/tp of the adapter), and after a sequence of writes,
overwrites and clears every rank's slot buffers equal its shard of the unsharded
buffers after the same sequence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from lora_core.base_shape import GROUPS, ROW_PARALLEL_GROUPS
from lora_core.slot_buffers import SlotBuffers
from lora_core.validate import validate_adapter_dir
from lora_core.weights import AdapterWeights, load_adapter_weights
from replica.models.loader import read_config
from replica.parallel import TPGroup, free_port
from replica.tp_driver import TPDriver
from replica.tp_protocol import HEADER_LEN, STOP, num_slices, pack_shard
from replica.tp_worker import apply_slot_command

TP = 2
SLOTS, MAX_RANK = 2, 16
# (slot, adapter name or None to clear): writes, a clear, a write into the cleared slot,
# an overwrite of a written one
OPS = ((0, "all16rs"), (1, "pattern"), (0, None), (0, "mlp4"), (1, "qv8"))


class _CountingGroup(TPGroup):
    """A TPGroup that counts the bytes it receives, by how (broadcast / recv)."""

    def __init__(self, rank: int = 0, size: int = 1, pg=None):
        super().__init__(rank, size, pg)
        self.received = {"broadcast": 0, "recv": 0}

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        self.received["broadcast"] += t.numel() * t.element_size()
        return super().broadcast(t, src)

    def recv(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        self.received["recv"] += t.numel() * t.element_size()
        return super().recv(t, src)


def _weights(model_dir: str, adapters: dict[str, str]) -> dict[str, AdapterWeights]:
    base = read_config(Path(model_dir)).base_shape
    return {
        name: load_adapter_weights(
            validate_adapter_dir(path, max_rank=MAX_RANK, base=base), base, torch.float32
        )
        for name, path in adapters.items()
    }


def _state(buffers: SlotBuffers) -> dict[str, torch.Tensor]:
    out = {"slot_ranks": buffers.slot_ranks.clone()}
    for layer in range(buffers.base.num_layers):
        for group in GROUPS:
            pairs = zip(buffers.a(layer, group), buffers.b(layer, group), strict=True)
            for s, (a, b) in enumerate(pairs):
                out[f"a.{layer}.{group}.{s}"] = a.contiguous()
                out[f"b.{layer}.{group}.{s}"] = b.contiguous()
    return out


def _driver_main(buffers: SlotBuffers, group: TPGroup, weights: dict[str, AdapterWeights]):
    driver = TPDriver(group, [], torch.device("cpu"), torch.float32)
    buffers.on_change = lambda slot, w: driver.slot_changed(buffers.base, slot, w)
    for slot, name in OPS:
        if name is None:
            buffers.clear(slot)
        else:
            buffers.write(slot, weights[name])
    driver.close()


def _worker_main(buffers: SlotBuffers, group: _CountingGroup) -> torch.Tensor:
    """Follow slot commands until STOP -> int64 [len(OPS), 2]: bytes broadcast to and
    sent to this rank per command (the header included)."""
    log = []
    head = torch.zeros(HEADER_LEN, dtype=torch.long)
    while True:
        before = dict(group.received)
        h = group.broadcast(head).tolist()
        if h[0] == STOP:
            return torch.tensor(log, dtype=torch.long)
        apply_slot_command(group, buffers, h)
        log.append([group.received[k] - before[k] for k in ("broadcast", "recv")])


def _rank_main(rank: int, port: int, model_dir: str, adapters: dict[str, str], out: str):
    group = _CountingGroup.connect(rank, TP, port, "gloo", timeout_s=120)
    base = read_config(Path(model_dir)).base_shape
    buffers = SlotBuffers(base, SLOTS, MAX_RANK, torch.float32, "cpu", rank, TP)
    if rank == 0:
        _driver_main(buffers, group, _weights(model_dir, adapters))
        state = _state(buffers)
    else:
        received = _worker_main(buffers, group)
        group.close()
        state = {**_state(buffers), "received": received}
    save_file(state, f"{out}/rank{rank}.safetensors")


def _shard_of(whole: dict[str, torch.Tensor], key: str, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of a whole buffer [L, R, H] (a) or [L, N, R] (b); slot_ranks
    are the same on every rank."""
    t = whole[key]
    if key == "slot_ranks":
        return t
    kind, _, group, _ = key.split(".")
    if kind == "a" and group in ROW_PARALLEL_GROUPS:
        return t.chunk(TP, dim=2)[rank]
    if kind == "b" and group not in ROW_PARALLEL_GROUPS:
        return t.chunk(TP, dim=1)[rank]
    return t


@pytest.fixture(scope="module")
def adapter_paths(llama_adapters) -> dict[str, str]:
    names = {name for _, name in OPS if name is not None}
    return {name: str(llama_adapters[name]) for name in names}


def test_worker_receives_its_shard_only(llama_dir, adapter_paths, tmp_path):
    mp.spawn(
        _rank_main,
        args=(free_port(), str(llama_dir), adapter_paths, str(tmp_path)),
        nprocs=TP,
        join=True,
    )
    ranks = [load_file(tmp_path / f"rank{r}.safetensors") for r in range(TP)]
    base = read_config(Path(llama_dir)).base_shape
    weights = _weights(str(llama_dir), adapter_paths)

    received = ranks[1].pop("received").tolist()
    cpu = torch.device("cpu")
    assert len(received) == len(OPS)
    for (_, name), (broadcast, recv) in zip(OPS, received, strict=True):
        if name is None:  # a clear: the header only
            assert (broadcast, recv) == (HEADER_LEN * 8, 0)
            continue
        shard = pack_shard(weights[name], base, 1, TP, cpu, torch.float32).numel() * 4
        whole = pack_shard(weights[name], base, 0, 1, cpu, torch.float32).numel() * 4
        assert recv == shard, name
        assert whole / TP <= shard < whole, name  # column-parallel groups keep A whole
        assert broadcast == (HEADER_LEN + num_slices(base)) * 8

    unsharded = SlotBuffers(base, SLOTS, MAX_RANK, torch.float32, "cpu")
    for slot, name in OPS:
        if name is None:
            unsharded.clear(slot)
        else:
            unsharded.write(slot, weights[name])
    whole = _state(unsharded)
    assert whole["a.0.qkv.0"].abs().sum() > 0 and whole["b.1.down.0"].abs().sum() > 0
    for rank, state in enumerate(ranks):
        assert state.keys() == whole.keys()
        for key in whole:
            assert state[key].equal(_shard_of(whole, key, rank)), (rank, key)
