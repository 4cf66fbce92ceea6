"""GPU adapter slots: preallocated stacked A/B buffers in the kernel layout.

For every layer and group (qkv, o, gate_up, down) and each of its S slices:
    A_s: [L, R, H]   B_s: [L, N_s, R]      (L = max_loras slots, R = max_rank)
exactly what `kernels.lora_shrink` / `kernels.lora_expand` take (B_s is stored
rank-major, a transposed view of [L, R, N_s]; the kernels read it through strides).
A slot holding an adapter of rank r has rows/columns r..R-1 zero, and untargeted
slices all zero, so the padded rank contributes nothing.
"""

from __future__ import annotations

import torch

from lora_core.base_shape import GROUPS, BaseShape
from lora_core.errors import AdapterIncompatible
from lora_core.weights import AdapterWeights, SliceWeights


class SlotBuffers:
    """All slots of one model replica (one device)."""

    def __init__(
        self,
        base: BaseShape,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras={max_loras}, max_rank={max_rank}; allowed: both >= 1")
        self.base = base
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = torch.device(device)
        self._a: list[dict[str, tuple[torch.Tensor, ...]]] = []
        self._b: list[dict[str, tuple[torch.Tensor, ...]]] = []
        for _ in range(base.num_layers):
            self._a.append({g: self._alloc_a(g) for g in GROUPS})
            self._b.append({g: self._alloc_b(g) for g in GROUPS})
        self.slot_ranks = torch.zeros(max_loras, dtype=torch.int32, device=self.device)

    def _alloc_a(self, group: str) -> tuple[torch.Tensor, ...]:
        h, outs = self.base.group_sizes(group)
        shape = (self.max_loras, self.max_rank, h)
        return tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in outs)

    def _alloc_b(self, group: str) -> tuple[torch.Tensor, ...]:
        """Stored rank-major ([L, R, N_s], viewed as [L, N_s, R]): a slot of rank r keeps
        its B in r contiguous rows, so the expand kernel reads only those (coalesced
        along N) instead of r of every R elements of each of N rows."""
        _, outs = self.base.group_sizes(group)
        return tuple(
            torch.zeros(
                (self.max_loras, self.max_rank, n), dtype=self.dtype, device=self.device
            ).transpose(1, 2)
            for n in outs
        )

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
                self.write_slices(slot, layer, group, weights.slices(layer, group))
        self.slot_ranks[slot] = weights.rank

    def write_slices(
        self, slot: int, layer: int, group: str, slices: tuple[SliceWeights | None, ...]
    ) -> None:
        """Set one layer-group of `slot`; None slices become zero."""
        for a_buf, b_buf, sw in zip(
            self._a[layer][group], self._b[layer][group], slices, strict=True
        ):
            a_buf[slot].zero_()
            b_buf[slot].zero_()
            if sw is not None:
                r = sw.rank
                if sw.a.shape[1] != a_buf.shape[2] or sw.b.shape[0] != b_buf.shape[1]:
                    raise AdapterIncompatible(
                        f"layers[{layer}].{group}",
                        f"A {list(sw.a.shape)} / B {list(sw.b.shape)} do not fit the slots",
                        f"A [r, {a_buf.shape[2]}], B [{b_buf.shape[1]}, r]",
                    )
                a_buf[slot, :r].copy_(sw.a, non_blocking=True)
                b_buf[slot, :, :r].copy_(sw.b, non_blocking=True)

    def clear(self, slot: int) -> None:
        """Zero `slot` entirely (its tokens then get a zero delta)."""
        self._check_slot(slot)
        for bufs in (self._a, self._b):
            for layer in bufs:
                for group in layer.values():
                    for t in group:
                        t[slot].zero_()
        self.slot_ranks[slot] = 0

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot={slot}; allowed: 0 <= slot < {self.max_loras}")
