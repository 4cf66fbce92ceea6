"""Per-step LoRA metadata shared by every LoRA layer of one model."""

from __future__ import annotations

import torch

import kernels
from kernels.meta import default_block_m, grid_follows_expected_slots
from lora_core.base_shape import BaseShape


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
        workspace_per_token: int = 0,
        workspace_tokens: int = 256,
        max_rank: int | None = None,
    ):
        """slot_ranks: int32 [L] on device, the actual rank per slot (SlotBuffers.slot_ranks);
        with it, each step builds one `kernels.SegmentMeta` that every layer shares, so
        tokens are grouped by slot once per step and padded rank is skipped.

        workspace_per_token: float32 elements of shrink output one token needs across the
        whole model (sum over layers and groups of S * R); with it, steps of at most
        workspace_tokens tokens zero one workspace with one memset and hand each layer a
        slice (`take`), instead of one memset per LoRA layer (decode's fixed cost).

        max_rank: the slot width R (SlotBuffers.max_rank); the kernels' tile height
        follows it (kernels.meta.default_block_m)."""
        if max_num_tokens < 1:
            raise ValueError(f"max_num_tokens={max_num_tokens}; allowed: >= 1")
        self.max_num_tokens = max_num_tokens
        self._buf = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=device)
        self.token_slots = self._buf[:0]
        self.any_lora = False
        self.slot_ranks = slot_ranks
        self.max_rank = max_rank
        self.meta: kernels.SegmentMeta | None = None
        self._per_token = workspace_per_token
        self._ws_tokens = min(workspace_tokens, max_num_tokens) if workspace_per_token else 0
        self._ws = torch.zeros(
            self._ws_tokens * workspace_per_token, dtype=torch.float32, device=device
        )
        self._ws_end = 0
        self._ws_next = 0

    def set(
        self, token_slots: torch.Tensor, any_lora: bool, expected_slots: int | None = None
    ) -> None:
        """token_slots: int [T] (any device); any_lora: whether some slot is >= 0.

        expected_slots: distinct slots the step holds, or a bound on them, where the caller
        knows it on the host (the batch it formed): the kernels size their tile grids for
        that many instead of for all L slots (kernels.SegmentMeta.expected_slots). A step
        with more is still computed whole, only slower. Capped at L."""
        n = token_slots.shape[0]
        if n > self.max_num_tokens:
            raise ValueError(f"{n} tokens; allowed: <= max_num_tokens={self.max_num_tokens}")
        self._buf[:n].copy_(token_slots, non_blocking=True)
        self.token_slots = self._buf[:n]
        self.any_lora = any_lora
        if any_lora and self.slot_ranks is not None:
            num_slots = self.slot_ranks.shape[0]
            self.meta = kernels.build_meta(
                self.token_slots,
                num_slots,
                self.slot_ranks,
                max_rank=self.max_rank,
                expected_slots=None if expected_slots is None else min(expected_slots, num_slots),
            )
        else:
            self.meta = None
        self._ws_next = 0
        self._ws_end = 0
        if any_lora and n <= self._ws_tokens:
            self._ws_end = n * self._per_token
            self._ws[: self._ws_end].zero_()

    def grid_follows_expected_slots(self, num_tokens: int) -> bool:
        """Whether a step of num_tokens tokens runs kernels whose grids follow set()'s
        expected_slots (kernels.meta.grid_follows_expected_slots for the tile height this
        pool's rank gives such a step): where they do not, a caller keying CUDA graphs by
        it would only capture copies."""
        return grid_follows_expected_slots(default_block_m(num_tokens, self.max_rank))

    def take(self, slices: int, tokens: int, rank: int) -> torch.Tensor | None:
        """A zeroed float32 [slices, tokens, rank] slice of this step's workspace, or None
        (no workspace, step too large, or used up) to let the kernel allocate its own."""
        size = slices * tokens * rank
        if self._ws_next + size > self._ws_end:
            return None
        view = self._ws[self._ws_next : self._ws_next + size].view(slices, tokens, rank)
        self._ws_next += size
        return view

    @property
    def kernel_slots(self) -> torch.Tensor | kernels.SegmentMeta:
        """What the kernels take: the step's SegmentMeta when built, else the slot map."""
        return self.meta if self.meta is not None else self.token_slots

    def set_slots(self, slots: list[int]) -> None:
        """Host-side convenience: set from a Python list, deriving any_lora."""
        self.set(torch.tensor(slots, dtype=torch.int32), any(s >= 0 for s in slots))


def workspace_per_token(base: BaseShape, max_rank: int) -> int:
    """Shrink-output elements one token needs across all LoRA layers of the model."""
    return base.num_layers * len(base.lora_modules) * max_rank
