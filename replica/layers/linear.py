"""Linear layers written for tensor parallelism (tp_size = 1 today).

Each layer owns the full weight of its shard and a `weight_loader` that copies a
checkpoint tensor (or one slice of a fused layer) into place; a TP pass only has
to narrow those copies. Fused layers record `output_sizes`, the out-features of each
slice in order (qkv: q, k, v; gate_up: gate, up) — LoRA wrappers rely on it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x @ W^T (+ b). weight: [N, H]; bias: [N] or None."""

    def __init__(
        self, in_features: int, output_sizes: tuple[int, ...], bias: bool, tp_size: int = 1
    ):
        super().__init__()
        if tp_size != 1:
            raise NotImplementedError("tensor parallelism: tp_size must be 1 for now")
        self.in_features = in_features
        self.output_sizes = tuple(output_sizes)
        self.out_features = sum(output_sizes)
        self.tp_size = tp_size
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, N]."""
        return F.linear(x, self.weight, self.bias)

    def slice_offset(self, shard: int) -> int:
        return sum(self.output_sizes[:shard])

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None
    ) -> None:
        """Copy `loaded` (a whole weight, or slice `shard` of a fused one) into `param`."""
        if shard is None:
            if param.shape != loaded.shape:
                raise ValueError(f"shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
            param.data.copy_(loaded)
            return
        start, size = self.slice_offset(shard), self.output_sizes[shard]
        target = param.data.narrow(0, start, size)
        if target.shape != loaded.shape:
            raise ValueError(
                f"slice {shard}: shape {tuple(loaded.shape)} does not fit {tuple(target.shape)}"
            )
        target.copy_(loaded)


class ColumnParallelLinear(Linear):
    """Output features split across TP ranks (one slice)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, (out_features,), bias)


class MergedColumnParallelLinear(Linear):
    """Several column-parallel outputs fused into one GEMM (gate_up: gate, up)."""

    def __init__(self, in_features: int, output_sizes: tuple[int, ...], bias: bool = False):
        super().__init__(in_features, output_sizes, bias)


class QKVParallelLinear(Linear):
    """Fused q, k, v projection: output_sizes = (heads*d, kv_heads*d, kv_heads*d)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool):
        super().__init__(
            hidden, (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim), bias
        )


class RowParallelLinear(Linear):
    """Input features split across TP ranks; an all-reduce would follow (none at tp_size 1)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, (out_features,), bias)
