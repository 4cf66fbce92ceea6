"""GPU adapter slots: preallocated stacked A/B buffers in the kernel layout.

For every layer and group the base adapts (BaseShape.lora_groups: qkv, o, gate_up, down;
qkv and o alone for a mixture-of-experts model) and each of its S slices:
    A_s: [L, R, H]   B_s: [L, N_s, R]      (L = max_loras slots, R = max_rank)
exactly what `kernels.lora_shrink` / `kernels.lora_expand` take (B_s is stored
rank-major, a transposed view of [L, R, N_s]; the kernels read it through strides).
A slot holding an adapter of rank r has rows/columns r..R-1 zero, and untargeted
slices all zero, so the padded rank contributes nothing.

With tensor parallelism (tp_size > 1) the buffers of rank tp_rank hold only its shard,
matching the base layers it wraps (BaseShape.shard_sizes):
    column-parallel groups (qkv, gate_up): A_s [L, R, H] whole, B_s [L, N_s/tp, R] rows
        [tp_rank * N_s/tp, ...) of every slice (x is whole on every rank);
    row-parallel groups (o, down): A [L, R, H/tp] columns [tp_rank * H/tp, ...) (x is
        split along H), B [L, N, R] whole.
So slot memory per device shrinks by about tp. `write` takes whole CPU adapter weights
and narrows them to the rank's shard (`shard_slice`); `write_shard` takes weights already
narrowed to it (what a tensor-parallel worker receives from the driver).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lora_core.base_shape import GROUPS, ROW_PARALLEL_GROUPS, BaseShape
from lora_core.errors import AdapterIncompatible
from lora_core.weights import AdapterWeights, SliceWeights


def shard_slice(sw: SliceWeights, group: str, tp_rank: int, tp_size: int) -> SliceWeights:
    """Rank tp_rank's shard of one whole slice (views, no copy).

    sw: a [r, H], b [N, r] -> row-parallel groups (o, down): a [r, H/tp] columns
    [tp_rank * H/tp, ...), b whole; column-parallel groups: a whole, b [N/tp, r] rows
    [tp_rank * N/tp, ...). Example (tp 2, down, H 16): rank 1 keeps a[:, 8:16].
    """
    if tp_size == 1:
        return sw
    if group in ROW_PARALLEL_GROUPS:
        h = sw.a.shape[1] // tp_size
        return SliceWeights(sw.a.narrow(1, tp_rank * h, h), sw.b)
    n = sw.b.shape[0] // tp_size
    return SliceWeights(sw.a, sw.b.narrow(0, tp_rank * n, n))


class SlotBuffers:
    """All slots of one model replica's device (one TP rank's shard of them)."""

    def __init__(
        self,
        base: BaseShape,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras={max_loras}, max_rank={max_rank}; allowed: both >= 1")
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank}, tp_size={tp_size}; allowed: 0 <= rank < size")
        self.base = base
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = torch.device(device)
        self._a: list[dict[str, tuple[torch.Tensor, ...]]] = []
        self._b: list[dict[str, tuple[torch.Tensor, ...]]] = []
        for _ in range(base.num_layers):
            self._a.append({g: self._alloc_a(g) for g in base.lora_groups})
            self._b.append({g: self._alloc_b(g) for g in base.lora_groups})
        self.slot_ranks = torch.zeros(max_loras, dtype=torch.int32, device=self.device)
        # Called after write(slot, weights) / clear(slot) (weights None) changed a slot: a
        # tensor-parallel driver replays the change on its other ranks' buffers.
        self.on_change: Callable[[int, AdapterWeights | None], None] | None = None

    def group_sizes(self, group: str) -> tuple[int, tuple[int, ...]]:
        """(in_features, out_features per slice) of this rank's shard of a group."""
        return self.base.shard_sizes(group, self.tp_size)

    def _alloc_a(self, group: str) -> tuple[torch.Tensor, ...]:
        h, outs = self.group_sizes(group)
        shape = (self.max_loras, self.max_rank, h)
        return tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in outs)

    def _alloc_b(self, group: str) -> tuple[torch.Tensor, ...]:
        """Stored rank-major ([L, R, N_s], viewed as [L, N_s, R]): a slot of rank r keeps
        its B in r contiguous rows, so the expand kernel reads only those (coalesced
        along N) instead of r of every R elements of each of N rows."""
        _, outs = self.group_sizes(group)
        return tuple(
            torch.zeros(
                (self.max_loras, self.max_rank, n), dtype=self.dtype, device=self.device
            ).transpose(1, 2)
            for n in outs
        )

    def stack_under(self, layer: int, group: str, weight: torch.Tensor) -> torch.Tensor:
        """The stacked layout of one layer's group: a new [N + S * L * R, H] tensor whose
        first N rows are `weight` (the base layer's [N, H]) and whose rest are this
        group's A slots, slice by slice ([L, R, H] each); from now on the group's A
        slots are views of those rows, so writing a slot writes the stacked weight and one
        GEMM, x @ stacked^T, computes the base output and every slot's shrink
        (`kernels.lora_expand_stacked` reads them). Example: qkv of a 4-slot rank-8 pool
        over W [48, 32] -> [48 + 3 * 4 * 8, 32]."""
        a = self._a[layer][group]
        h, device = a[0].shape[2], a[0].device  # the slots' own device ("cuda" is cuda:0)
        if weight.shape[1] != h or weight.dtype != self.dtype or weight.device != device:
            raise ValueError(
                f"weight: {tuple(weight.shape)} {weight.dtype} on {weight.device}; allowed: "
                f"[N, {h}] {self.dtype} on {device}"
            )
        rows = self.max_loras * self.max_rank
        stacked = torch.empty((weight.shape[0] + len(a) * rows, h), dtype=self.dtype, device=device)
        stacked[: weight.shape[0]].copy_(weight)
        tail = stacked[weight.shape[0] :]
        views = tuple(
            tail[i * rows : (i + 1) * rows].view(self.max_loras, self.max_rank, h)
            for i in range(len(a))
        )
        for view, old in zip(views, a, strict=True):
            view.copy_(old)
        self._a[layer][group] = views
        return stacked

    def a(self, layer: int, group: str) -> tuple[torch.Tensor, ...]:
        """S tensors [L, R, H] of one layer's group."""
        return self._a[layer][group]

    def b(self, layer: int, group: str) -> tuple[torch.Tensor, ...]:
        """S tensors [L, N_s, R] of one layer's group."""
        return self._b[layer][group]

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for bufs in (self._a, self._b)
            for layer in bufs
            for group in layer.values()
            for t in group
        )

    def write(self, slot: int, weights: AdapterWeights) -> None:
        """Copy an adapter into `slot` (zero-padding rank, zeroing untargeted slices)."""
        self._write(slot, weights, sharded=False)
        if self.on_change is not None:
            self.on_change(slot, weights)

    def write_shard(self, slot: int, weights: AdapterWeights) -> None:
        """write(), from weights already narrowed to this rank's shard (`shard_slice`):
        a tensor-parallel worker's copy of the driver's write. Calls no on_change."""
        self._write(slot, weights, sharded=True)

    def _write(self, slot: int, weights: AdapterWeights, sharded: bool) -> None:
        self._check_slot(slot)
        if weights.rank > self.max_rank:
            raise AdapterIncompatible(
                "rank",
                f"adapter rank {weights.rank} exceeds the slot width",
                f"rank <= {self.max_rank}",
            )
        if len(weights.layers) != self.base.num_layers:
            raise AdapterIncompatible(
                "layers", f"{len(weights.layers)} layers packed", f"{self.base.num_layers} layers"
            )
        for layer in range(self.base.num_layers):
            for group in GROUPS:
                slices = weights.slices(layer, group)
                if group in self.base.lora_groups:
                    self.write_slices(slot, layer, group, slices, sharded)
                elif any(sw is not None for sw in slices):  # validation refuses these
                    raise AdapterIncompatible(
                        f"layers[{layer}].{group}",
                        f"{self.base.architecture} is a mixture-of-experts model whose "
                        f"{self.base.moe_parts} take no LoRA",
                        f"adapters of {', '.join(self.base.lora_modules)}",
                    )
        self.slot_ranks[slot] = weights.rank

    def write_slices(
        self,
        slot: int,
        layer: int,
        group: str,
        slices: tuple[SliceWeights | None, ...],
        sharded: bool = False,
    ) -> None:
        """Set one layer-group of `slot` from whole slices (sharded: from this rank's
        shard of each, see `shard_slice`); None slices become zero. Only this rank's
        shard of a whole slice is copied."""
        h, outs = self.group_sizes(group) if sharded else self.base.group_sizes(group)
        for a_buf, b_buf, sw, n in zip(
            self._a[layer][group], self._b[layer][group], slices, outs, strict=True
        ):
            a_buf[slot].zero_()
            b_buf[slot].zero_()
            if sw is None:
                continue
            if sw.a.shape[1] != h or sw.b.shape[0] != n:
                raise AdapterIncompatible(
                    f"layers[{layer}].{group}",
                    f"A {list(sw.a.shape)} / B {list(sw.b.shape)} do not fit the slots",
                    f"A [r, {h}], B [{n}, r]",
                )
            if not sharded:
                sw = shard_slice(sw, group, self.tp_rank, self.tp_size)
            a_buf[slot, : sw.rank].copy_(sw.a, non_blocking=True)
            b_buf[slot, :, : sw.rank].copy_(sw.b, non_blocking=True)

    def clear(self, slot: int) -> None:
        """Zero `slot` entirely (its tokens then get a zero delta)."""
        self._check_slot(slot)
        for bufs in (self._a, self._b):
            for layer in bufs:
                for group in layer.values():
                    for t in group:
                        t[slot].zero_()
        self.slot_ranks[slot] = 0
        if self.on_change is not None:
            self.on_change(slot, None)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot={slot}; allowed: 0 <= slot < {self.max_loras}")
