"""LoRA as a pass over the engine's model: fused linears wrapped by `LinearWithLoRA`.

The wrapper keeps vLLM's small *WithLoRA contract: its weights live in the shared
`SlotBuffers` (created once), `set_slot` writes one slot, `reset_slot` zeroes it;
`forward` adds the segmented LoRA delta of each token's slot to the base output.

Stacked layout (`stacked=True`, EngineConfig.lora_stacked): a group's A slots live
under its base weight, rows of one [W; A_0; ...; A_{S-1}] tensor, so a step with LoRA
runs one GEMM, x @ [W; A]^T, for the base output and every slot's shrink, then the
expand reads each row's own slot columns out of it (`kernels.lora_expand_stacked`):
no shrink launch and no metadata-driven gather, at the cost of reading every slot's A
(`benchmarks/cublas_concat_probe.py`: 0.47-0.90x of the two-kernel layer where many
adapters of a rank-16 pool are active; worse with few adapters or rank 64). The
shrink's values are then the GEMM's dtype (bf16 on GPU), not fp32. Steps without LoRA
run the base rows alone, as before.

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
        stacked: bool = False,
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
        self.stacked: torch.Tensor | None = None
        if stacked:
            # the base weight becomes the first rows of [W; A slots]: one tensor, so the
            # slots cost no memory beyond what they cost before
            weight = base_layer.weight
            self.stacked = buffers.stack_under(layer, group, weight.data)
            base_layer.weight = nn.Parameter(self.stacked[: weight.shape[0]], requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, sum N_s] (this rank's shard sizes)."""
        if self.ctx.any_lora and self.stacked is not None:
            return self.base_layer.reduce(self._stacked(x))
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

    def _stacked(self, x: torch.Tensor) -> torch.Tensor:
        """The stacked layout: one GEMM for the base output and every slot's shrink, then
        the expand reading each row's slot columns, in place; y is a view (row stride
        N + S * L * R) of the GEMM's output."""
        base = self.base_layer
        out = torch.nn.functional.linear(x, self.stacked)
        n = sum(self.output_sizes)
        y = kernels.lora_expand_stacked(
            out, n, self.buffers.b(self.layer, self.group), self.ctx.kernel_slots
        )
        if base.bias is not None and not getattr(base, "row_parallel", False):
            y.add_(base.bias)  # matmul's bias; a row-parallel layer adds it after reduce
        return y

    def set_slot(self, slot: int, slices: tuple[SliceWeights | None, ...]) -> None:
        """Write this layer-group's slices of one adapter into `slot`."""
        self.buffers.write_slices(slot, self.layer, self.group, slices)

    def reset_slot(self, slot: int) -> None:
        self.buffers.write_slices(slot, self.layer, self.group, (None,) * len(GROUPS[self.group]))


def apply_lora(
    model: nn.Module, buffers: SlotBuffers, ctx: LoraBatchContext, stacked: bool = False
) -> None:
    """Replace qkv_proj, o_proj, gate_up_proj and down_proj of every `model.layers[i]`
    (qkv_proj and o_proj alone where the buffers' base is a mixture-of-experts model:
    BaseShape.lora_groups). stacked: the slots' A live under each base weight
    (`LinearWithLoRA` stacked)."""
    layers = model.layers
    if len(layers) != buffers.base.num_layers:
        raise ValueError(
            f"model has {len(layers)} layers; the slot buffers {buffers.base.num_layers}"
        )
    for i, decoder_layer in enumerate(layers):
        for path, group in LORA_TARGETS:
            if group not in buffers.base.lora_groups:
                continue
            parent_name, attr = path.split(".")
            parent = getattr(decoder_layer, parent_name)
            current = getattr(parent, attr)
            if isinstance(current, LinearWithLoRA):
                raise ValueError(f"layers[{i}].{path} is already wrapped; apply_lora runs once")
            setattr(parent, attr, LinearWithLoRA(current, i, group, buffers, ctx, stacked))


__all__ = ["LORA_TARGETS", "LinearWithLoRA", "apply_lora"]
