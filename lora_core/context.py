"""Per-step LoRA metadata shared by every LoRA layer of one model."""

from __future__ import annotations

import torch


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

    def __init__(self, max_num_tokens: int, device: torch.device | str):
        if max_num_tokens < 1:
            raise ValueError(f"max_num_tokens={max_num_tokens}; allowed: >= 1")
        self.max_num_tokens = max_num_tokens
        self._buf = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=device)
        self.token_slots = self._buf[:0]
        self.any_lora = False

    def set(self, token_slots: torch.Tensor, any_lora: bool) -> None:
        """token_slots: int [T] (any device); any_lora: whether some slot is >= 0."""
        n = token_slots.shape[0]
        if n > self.max_num_tokens:
            raise ValueError(f"{n} tokens; allowed: <= max_num_tokens={self.max_num_tokens}")
        self._buf[:n].copy_(token_slots, non_blocking=True)
        self.token_slots = self._buf[:n]
        self.any_lora = any_lora

    def set_slots(self, slots: list[int]) -> None:
        """Host-side convenience: set from a Python list, deriving any_lora."""
        self.set(torch.tensor(slots, dtype=torch.int32), any(s >= 0 for s in slots))
