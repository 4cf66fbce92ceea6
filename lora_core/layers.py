"""LoRA as a pass over the engine's model: fused linears wrapped by `LinearWithLoRA`.

The wrapper keeps vLLM's small *WithLoRA contract: its weights live in the shared
`SlotBuffers` (created once), `set_slot` writes one slot, `reset_slot` zeroes it;
`forward` adds the segmented LoRA delta of each token's slot to the base output.

Tensor parallelism: the wrapper adds its delta between the base layer's local GEMM
(`matmul`) and its communication (`reduce`), with slot buffers holding the rank's
shard (SlotBuffers). Column-parallel groups (qkv, gate_up): x is whole, A whole, B
split like the base weight's rows, so each rank computes exactly its output columns'
delta; no communication. Row-parallel groups (o, down): x is split along H, so is A;
the rank's shrink A_r @ x_r is a partial sum of A @ x, and as the expand is linear,
B @ (sum_r A_r x_r) = sum_r B @ (A_r x_r): each rank expands its partial shrink with
the whole B into its partial base output, and the base layer's one all-reduce sums
base and delta together. The delta is counted once, not tp times, and needs no extra
collective (an all-reduce of the [S, T, R] shrink output would be a second, latency-
bound one per layer); the cost is that every rank runs the whole expand, as it would
after a shrink all-reduce too.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from lora_core.base_shape import GROUPS
from lora_core.context import LoraBatchContext
from lora_core.slot_buffers import SlotBuffers
from lora_core.weights import SliceWeights

# (attribute path under model.layers[i], group), in the order GROUPS lists them.
LORA_TARGETS: tuple[tuple[str, str], ...] = (
    ("self_attn.qkv_proj", "qkv"),
    ("self_attn.o_proj", "o"),
    ("mlp.gate_up_proj", "gate_up"),
    ("mlp.down_proj", "down"),
)


class LinearWithLoRA(nn.Module):
    """base(x) + per-token LoRA delta, for one layer's group (qkv, o, gate_up or down).

    base_layer: a `replica.layers.linear.Linear` (or anything with this rank's
    `in_features` and `output_sizes`, `matmul` x: [T, H] -> [T, sum N_s] without
    communication and `reduce` [T, sum N_s] -> the layer's output); lora_core cannot
    import replica.
    """

    def __init__(
        self,
        base_layer: nn.Module,
        layer: int,
        group: str,
        buffers: SlotBuffers,
        ctx: LoraBatchContext,
    ):
        super().__init__()
        h, outs = buffers.group_sizes(group)
        got = (base_layer.in_features, tuple(base_layer.output_sizes))
        if got != (h, outs):
            raise ValueError(
                f"layers[{layer}].{group}: (in, output_sizes)={got} do not match the "
                f"base shape {(h, outs)}"
            )
        self.base_layer = base_layer
        self.layer = layer
        self.group = group
        self.buffers = buffers
        self.ctx = ctx
        self.in_features = base_layer.in_features
        self.output_sizes = tuple(base_layer.output_sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, sum N_s] (this rank's shard sizes)."""
        y = self.base_layer.matmul(x)
        if self.ctx.any_lora:
            a = self.buffers.a(self.layer, self.group)
            kernels.lora_shrink_expand(
                y,
                x,
                a,
                self.buffers.b(self.layer, self.group),
                self.ctx.kernel_slots,
                workspace=self.ctx.take(len(a), x.shape[0], a[0].shape[1]),
            )
        return self.base_layer.reduce(y)

    def set_slot(self, slot: int, slices: tuple[SliceWeights | None, ...]) -> None:
        """Write this layer-group's slices of one adapter into `slot`."""
        self.buffers.write_slices(slot, self.layer, self.group, slices)

    def reset_slot(self, slot: int) -> None:
        self.buffers.write_slices(slot, self.layer, self.group, (None,) * len(GROUPS[self.group]))


def apply_lora(model: nn.Module, buffers: SlotBuffers, ctx: LoraBatchContext) -> None:
    """Replace qkv_proj, o_proj, gate_up_proj and down_proj of every `model.layers[i]`."""
    layers = model.layers
    if len(layers) != buffers.base.num_layers:
        raise ValueError(
            f"model has {len(layers)} layers; the slot buffers {buffers.base.num_layers}"
        )
    for i, decoder_layer in enumerate(layers):
        for path, group in LORA_TARGETS:
            parent_name, attr = path.split(".")
            parent = getattr(decoder_layer, parent_name)
            current = getattr(parent, attr)
            if isinstance(current, LinearWithLoRA):
                raise ValueError(f"layers[{i}].{path} is already wrapped; apply_lora runs once")
            setattr(parent, attr, LinearWithLoRA(current, i, group, buffers, ctx))


__all__ = ["LORA_TARGETS", "LinearWithLoRA", "apply_lora"]
