"""Linear layers sharded Megatron-style across a tensor-parallel group.

Column-parallel layers (qkv, gate_up) split their output features: rank r of tp keeps
rows [r * N_s/tp, (r+1) * N_s/tp) of every slice s, takes the whole (replicated) input
and needs no communication. Row-parallel layers (o, down) split their input features:
rank r keeps columns [r * H/tp, (r+1) * H/tp), takes its shard of the input (what the
column-parallel layer before it produced) and all-reduces its partial [T, N] output;
the bias (replicated) is added once, after the all-reduce.

Each layer's `weight_loader` copies the rank's shard of a checkpoint tensor (or of one
slice of a fused layer) into place. `output_sizes` and `in_features` are the rank's
(local) sizes, what LoRA wrappers match their slot buffers against; `matmul` (local
GEMM) and `reduce` (the group's communication plus the bias) split `forward` so a LoRA
wrapper can add its delta in between.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from replica.parallel import SINGLE, TPGroup

# A checkpoint tensor, or a safetensors slice of one (indexable like a tensor; its
# get_shape() is the tensor's shape): what a weight loader reads its shard from.
Sliceable = Any


class Linear(nn.Module):
    """One rank's shard of y = x @ W^T (+ b). weight: [N_local, H_local]; bias: [N_local]
    (column-parallel) or [N] (row-parallel) or None.

    full_in: the checkpoint's in-features; full_sizes: its out-features per slice.
    row_parallel: split the input (else the output) across `tp`.
    """

    def __init__(
        self,
        full_in: int,
        full_sizes: tuple[int, ...],
        bias: bool,
        tp: TPGroup = SINGLE,
        row_parallel: bool = False,
    ):
        super().__init__()
        self.tp = tp
        self.row_parallel = row_parallel
        self.full_in = full_in
        self.full_sizes = tuple(full_sizes)
        if row_parallel:
            self.in_features = tp.shard(full_in, "in_features")
            self.output_sizes = self.full_sizes
        else:
            self.in_features = full_in
            self.output_sizes = tuple(tp.shard(n, "out_features") for n in self.full_sizes)
        self.out_features = sum(self.output_sizes)
        self.weight = nn.Parameter(
            torch.empty(self.out_features, self.in_features), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H_local] -> [T, N_local] (row-parallel: [T, N], summed over the group)."""
        return self.reduce(self.matmul(x))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The rank's GEMM without communication: x: [T, H_local] -> [T, N_local]; a
        row-parallel layer returns its partial sum, without the bias."""
        return F.linear(x, self.weight, None if self.row_parallel else self.bias)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """matmul's output -> the layer's output: row-parallel all-reduces it and adds the
        bias; column-parallel returns it as is."""
        if not self.row_parallel:
            return y
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y.add_(self.bias)

    def slice_offset(self, shard: int) -> int:
        """Local row offset of slice `shard`."""
        return sum(self.output_sizes[:shard])

    def weight_loader(
        self, param: nn.Parameter, loaded: Sliceable, shard: int | None = None
    ) -> None:
        """Copy the rank's part of `loaded` into `param`, reading nothing else of it.

        loaded: the checkpoint's whole weight [N, H] / bias [N], or slice `shard` of a
        fused one ([N_s, H] / [N_s]), unsharded: a tensor, or a safetensors slice
        (`safe_open(...).get_slice(name)`), so a rank reads only its rows or columns
        from the file. Values are cast to param's dtype as they are copied.
        """
        shape = shape_of(loaded)
        if shard is None:
            want = (sum(self.full_sizes), self.full_in)[: len(shape)]
            if shape != want:
                raise ValueError(f"shape {shape} does not fit {want}")
            if self.row_parallel:
                param.data.copy_(self._input_part(loaded, len(shape)))
                return
            start = 0
            for s, size in enumerate(self.full_sizes):
                self._copy_rows(param, loaded, s, start)
                start += size
            return
        want = (self.full_sizes[shard], self.full_in)[: len(shape)]
        if shape != want:
            raise ValueError(f"slice {shard}: shape {shape} does not fit {want}")
        if self.row_parallel:
            target = param.data.narrow(0, self.slice_offset(shard), self.output_sizes[shard])
            target.copy_(self._input_part(loaded, len(shape)))
        else:
            self._copy_rows(param, loaded, shard, 0)

    def _copy_rows(self, param: nn.Parameter, loaded: Sliceable, shard: int, start: int) -> None:
        """Column-parallel: this rank's rows of slice `shard`, which starts at row `start`
        of loaded, into their place in param."""
        local = self.output_sizes[shard]
        lo = start + self.tp.rank * local
        param.data.narrow(0, self.slice_offset(shard), local).copy_(loaded[lo : lo + local])

    def _input_part(self, loaded: Sliceable, ndim: int) -> torch.Tensor:
        """Row-parallel: a weight's input columns of this rank (a bias is replicated)."""
        if ndim == 1:
            return loaded[:]
        lo = self.tp.rank * self.in_features
        return loaded[:, lo : lo + self.in_features]


def shape_of(loaded: Sliceable) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


class ColumnParallelLinear(Linear):
    """Output features split across TP ranks (one slice)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = SINGLE
    ):
        super().__init__(in_features, (out_features,), bias, tp)


class MergedColumnParallelLinear(Linear):
    """Several column-parallel outputs fused into one GEMM (gate_up: gate, up); each
    slice is split on its own, so a rank holds gate rows and the matching up rows."""

    def __init__(
        self,
        in_features: int,
        output_sizes: tuple[int, ...],
        bias: bool = False,
        tp: TPGroup = SINGLE,
    ):
        super().__init__(in_features, output_sizes, bias, tp)


class QKVParallelLinear(Linear):
    """Fused q, k, v projection: output_sizes = (heads*d, kv_heads*d, kv_heads*d) / tp.

    Split by heads: rank r holds q heads [r * heads/tp, ...) and the kv heads their
    group shares, so both head counts must divide by tp (refused otherwise).
    """

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TPGroup = SINGLE,
    ):
        tp.shard(num_heads, "num_attention_heads")
        tp.shard(num_kv_heads, "num_key_value_heads")
        super().__init__(
            hidden,
            (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim),
            bias,
            tp,
        )


class RowParallelLinear(Linear):
    """Input features split across TP ranks; the partial outputs are all-reduced."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = SINGLE
    ):
        super().__init__(in_features, (out_features,), bias, tp, row_parallel=True)
