"""The dense SwiGLU MLP, tensor-parallel Megatron style: each rank holds intermediate/tp
features of gate, up (column-parallel, fused as gate_up_proj) and down (row-parallel).

Semantics (x: [T, H]): y = down(silu(gate(x)) * up(x)); under TP rank r computes
down_r(silu(gate_r x) * up_r x) over its own features and the down projection
all-reduces the ranks' partial [T, H] sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replica.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from replica.parallel import SINGLE, TPGroup


class MLP(nn.Module):
    """This rank's intermediate/tp features of gate, up and down. intermediate: the
    checkpoint's intermediate size; field: the config field it came from (refusals
    name it when tp does not divide it)."""

    def __init__(
        self, hidden: int, intermediate: int, tp: TPGroup = SINGLE, field: str = "intermediate_size"
    ):
        super().__init__()
        self.intermediate = tp.shard(intermediate, field)
        self.gate_up_proj = MergedColumnParallelLinear(hidden, (intermediate,) * 2, tp=tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H], summed over the group."""
        return self.down_proj(self._hidden(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> this rank's partial [T, H] (forward before the all-reduce), for a
        caller that adds it to other partial sums and reduces them all at once."""
        return self.down_proj.matmul(self._hidden(x))

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return F.silu(gate) * up
