"""Per-step LoRA metadata shared by every LoRA layer of one model."""

from __future__ import annotations

import torch

import kernels


class LoraBatchContext:
    """Which slot each token of the current step uses.

    token_slots: int32 [T] on device; slot of each token's adapter, -1 for base-model
        tokens. It is a view of a preallocated [max_num_tokens] buffer, so its storage
        never moves (CUDA-graph friendly).
    any_lora: False when no token of the step has an adapter; layers then skip the
        kernels entirely.

    Example: three sequences, the first two with adapters in slots 2 and 0, the last
    on the base model, with 3 + 1 + 2 tokens: token_slots = [2, 2, 2, 0, -1, -1].
    """

    def __init__(
        self,
        max_num_tokens: int,
        device: torch.device | str,
        slot_ranks: torch.Tensor | None = None,
    ):
        """slot_ranks: int32 [L] on device, the actual rank per slot (SlotBuffers.slot_ranks);
        with it, each step builds one `kernels.SegmentMeta` that every layer shares, so
        tokens are grouped by slot once per step and padded rank is skipped."""
        if max_num_tokens < 1:
            raise ValueError(f"max_num_tokens={max_num_tokens}; allowed: >= 1")
        self.max_num_tokens = max_num_tokens
        self._buf = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=device)
        self.token_slots = self._buf[:0]
        self.any_lora = False
        self.slot_ranks = slot_ranks
        self.meta: kernels.SegmentMeta | None = None

    def set(self, token_slots: torch.Tensor, any_lora: bool) -> None:
        """token_slots: int [T] (any device); any_lora: whether some slot is >= 0."""
        n = token_slots.shape[0]
        if n > self.max_num_tokens:
            raise ValueError(f"{n} tokens; allowed: <= max_num_tokens={self.max_num_tokens}")
        self._buf[:n].copy_(token_slots, non_blocking=True)
        self.token_slots = self._buf[:n]
        self.any_lora = any_lora
        if any_lora and self.slot_ranks is not None:
            self.meta = kernels.build_meta(
                self.token_slots, self.slot_ranks.shape[0], self.slot_ranks
            )
        else:
            self.meta = None

    @property
    def kernel_slots(self) -> torch.Tensor | kernels.SegmentMeta:
        """What the kernels take: the step's SegmentMeta when built, else the slot map."""
        return self.meta if self.meta is not None else self.token_slots

    def set_slots(self, slots: list[int]) -> None:
        """Host-side convenience: set from a Python list, deriving any_lora."""
        self.set(torch.tensor(slots, dtype=torch.int32), any(s >= 0 for s in slots))
