"""Per-step LoRA metadata shared by every LoRA layer of one model."""

from __future__ import annotations

import torch


class LoraBatchContext:
    """Which slot each token of the current step uses.

    token_slots: int32/int64 [T] on the model's device; slot of each token's adapter,
        -1 for base-model tokens.
    any_lora: False when no token of the step has an adapter; layers then skip the
        kernels entirely.
    max_num_tokens: when given, token_slots is a view of a preallocated int32
        [max_num_tokens] buffer on `device` whose storage never moves (CUDA-graph
        friendly); when None, set() keeps the tensor it is given.

    Example: three sequences, the first two with adapters in slots 2 and 0, the last
    on the base model, with 3 + 1 + 2 tokens: token_slots = [2, 2, 2, 0, -1, -1].
    """

    def __init__(self, max_num_tokens: int | None = None, device: torch.device | str = "cpu"):
        if max_num_tokens is not None and max_num_tokens < 1:
            raise ValueError(f"max_num_tokens={max_num_tokens}; allowed: None or >= 1")
        self.max_num_tokens = max_num_tokens
        self._buf = None
        if max_num_tokens is not None:
            self._buf = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=device)
        self.token_slots = torch.empty(0, dtype=torch.int32, device=device)
        self.any_lora = False

    def set(self, token_slots: torch.Tensor, any_lora: bool) -> None:
        """token_slots: int [T]; any_lora: whether some slot is >= 0 (known on the host)."""
        if self._buf is None:
            self.token_slots = token_slots
        else:
            n = token_slots.shape[0]
            if n > self._buf.shape[0]:
                raise ValueError(f"{n} tokens; allowed: <= max_num_tokens={self.max_num_tokens}")
            self._buf[:n].copy_(token_slots, non_blocking=True)
            self.token_slots = self._buf[:n]
        self.any_lora = any_lora

    def set_slots(self, slots: list[int]) -> None:
        """Host-side convenience: set from a Python list, deriving any_lora."""
        device = self.token_slots.device
        self.set(torch.tensor(slots, dtype=torch.int32, device=device), any(s >= 0 for s in slots))
