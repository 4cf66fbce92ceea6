"""A sharded linear layer reads only its rank's part of a checkpoint tensor: handed a
safetensors slice, it asks for its rows (column-parallel) or columns (row-parallel)
alone, and the values land as the narrowed whole tensor would put them."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from replica.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from replica.parallel import TPGroup


class Recording:
    """A safetensors slice that records every index asked of it."""

    def __init__(self, inner):
        self.inner, self.asked = inner, []

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, index):
        self.asked.append(index)
        return self.inner[index]


def _group(rank: int, size: int) -> TPGroup:
    return TPGroup(rank, size, pg=object())  # loading runs no collective


def _rows_read(asked) -> int:
    rows = 0
    for index in asked:
        first = index[0] if isinstance(index, tuple) else index
        rows += (first.stop or 0) - (first.start or 0)
    return rows


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_reads_only_its_shard(tmp_path, rank):
    hidden, inter = 8, 12
    gate, up = torch.randn(inter, hidden), torch.randn(inter, hidden)
    down, q = torch.randn(hidden, inter), torch.randn(8, hidden)
    k, v = torch.randn(4, hidden), torch.randn(4, hidden)
    path = tmp_path / "w.safetensors"
    save_file({"gate": gate, "up": up, "down": down, "q": q, "k": k, "v": v}, str(path))
    tp = _group(rank, 2)
    gate_up = MergedColumnParallelLinear(hidden, (inter, inter), tp=tp)
    row = RowParallelLinear(inter, hidden, tp=tp)
    qkv = QKVParallelLinear(hidden, 2, 4, 2, bias=False, tp=tp)
    with safe_open(str(path), framework="pt") as f:
        read = {}
        for layer, names in ((gate_up, ("gate", "up")), (qkv, ("q", "k", "v"))):
            for shard, name in enumerate(names):
                read[name] = Recording(f.get_slice(name))
                layer.weight_loader(layer.weight, read[name], shard)
        read["down"] = Recording(f.get_slice("down"))
        row.weight_loader(row.weight, read["down"], None)

    half = slice(rank * 6, rank * 6 + 6)
    assert torch.equal(gate_up.weight, torch.cat([gate[half], up[half]]))
    assert torch.equal(row.weight, down[:, half])
    qh, kh = slice(rank * 4, rank * 4 + 4), slice(rank * 2, rank * 2 + 2)
    assert torch.equal(qkv.weight, torch.cat([q[qh], k[kh], v[kh]]))
    # column-parallel: half the rows of each slice; row-parallel: half the columns
    assert [_rows_read(read[n].asked) for n in ("gate", "up", "q", "k", "v")] == [6, 6, 4, 2, 2]
    ((all_rows, cols),) = read["down"].asked
    assert all_rows == slice(None) and (cols.start, cols.stop) == (rank * 6, rank * 6 + 6)


def test_a_tensor_loads_as_a_slice_does():
    tp = _group(1, 2)
    layer = MergedColumnParallelLinear(4, (6, 6), tp=tp)
    whole = torch.randn(12, 4, dtype=torch.bfloat16)
    layer.weight_loader(layer.weight, whole)  # a pre-fused checkpoint tensor
    assert layer.weight.dtype == torch.float32
    assert torch.equal(layer.weight, torch.cat([whole[3:6], whole[9:12]]).float())
    with pytest.raises(ValueError, match=r"shape \(12, 5\) does not fit \(12, 4\)"):
        layer.weight_loader(layer.weight, torch.randn(12, 5))
