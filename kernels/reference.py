"""Torch reference for the segmented LoRA shrink/expand contract (see kernels/__init__.py).

Correct on any device and dtype; used on CPU by default and as the oracle for the
Triton kernels. Tokens are grouped by slot so the cost is one gather+matmul per
active slot, never per token. `slot_ranks` (int [L], the actual rank of each slot)
limits slot l to its first slot_ranks[l] rows of A / columns of B.

Small problems (decode batches, tiny models: the CPU engine's case) take a per-token
gather + bmm instead: the same arithmetic in a handful of ops, where the grouped loop
would spend its time in Python and op dispatch (16 slots x 3 slices per layer).
"""

from __future__ import annotations

import torch


def _groups(token_slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """[(slot, token_indices)] for every slot >= 0 present in token_slots."""
    slots = token_slots.tolist()
    by_slot: dict[int, list[int]] = {}
    for t, s in enumerate(slots):
        if s >= 0:
            by_slot.setdefault(s, []).append(t)
    dev = token_slots.device
    return [(s, torch.tensor(idx, device=dev, dtype=torch.long)) for s, idx in by_slot.items()]


def _in_range(token_slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Slots outside [-1, L) become -1, as the Triton path's metadata treats them
    (kernels.meta.build_meta): the same result on both backends, no out-of-range index."""
    ok = (token_slots >= 0) & (token_slots < num_slots)
    return torch.where(ok, token_slots, torch.full_like(token_slots, -1))


# Elements of the per-token gathered A or B below which gather + bmm is used.
_BMM_MAX_ELEMENTS = 1 << 22


def _token_mask(
    token_slots: torch.Tensor, slot_ranks: torch.Tensor | None, rank: int
) -> torch.Tensor:
    """bool [T, R]: token t has an adapter and r < its slot's rank."""
    safe = token_slots.clamp(min=0).long()
    mask = (token_slots >= 0)[:, None].expand(-1, rank)
    if slot_ranks is not None:
        r = torch.arange(rank, device=token_slots.device)
        mask = mask & (r[None, :] < slot_ranks.to(token_slots.device)[safe][:, None])
    return mask


def _shrink_bmm(x, lora_a, token_slots, scale, slot_ranks, acc) -> torch.Tensor:
    safe = token_slots.clamp(min=0).long()
    xs = x.to(acc)[:, :, None]
    out = torch.stack([torch.bmm(a[safe].to(acc), xs)[:, :, 0] for a in lora_a]) * scale
    mask = _token_mask(token_slots, slot_ranks, out.shape[2])
    return torch.where(mask[None], out, torch.zeros((), dtype=acc, device=x.device)).float()


def _expand_bmm(y, buf, lora_b, token_slots, add_inputs, slot_ranks, acc) -> torch.Tensor:
    safe = token_slots.clamp(min=0).long()
    mask = _token_mask(token_slots, slot_ranks, buf.shape[2])
    has = (token_slots >= 0)[:, None]
    offset = 0
    for s, b in enumerate(lora_b):
        n = b.shape[1]
        h = torch.where(mask, buf[s].to(acc), torch.zeros((), dtype=acc, device=y.device))
        delta = torch.bmm(b[safe].to(acc), h[:, :, None])[:, :, 0]
        cur = y[:, offset : offset + n]
        new = cur.to(acc) + delta if add_inputs else delta
        y[:, offset : offset + n] = torch.where(has, new.to(y.dtype), cur)
        offset += n
    return y


def _rank_of(slot: int, slot_ranks: torch.Tensor | None, rank: int) -> int:
    return rank if slot_ranks is None else min(int(slot_ranks[slot]), rank)


def lora_shrink_ref(
    x: torch.Tensor,
    lora_a: tuple[torch.Tensor, ...],
    token_slots: torch.Tensor,
    *,
    scale: float = 1.0,
    slot_ranks: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [T, H]; lora_a: S x [L, R, H]; token_slots: int [T] -> float32 [S, T, R]."""
    token_slots = _in_range(token_slots, lora_a[0].shape[0])
    num_slices = len(lora_a)
    tokens = x.shape[0]
    rank = lora_a[0].shape[1]
    out = torch.zeros(num_slices, tokens, rank, dtype=torch.float32, device=x.device)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    if tokens * rank * x.shape[1] <= _BMM_MAX_ELEMENTS:
        return _shrink_bmm(x, lora_a, token_slots, scale, slot_ranks, acc)
    for slot, idx in _groups(token_slots):
        r = _rank_of(slot, slot_ranks, rank)
        xs = x.index_select(0, idx).to(acc)
        for s, a in enumerate(lora_a):
            out[s, idx, :r] = (scale * (xs @ a[slot, :r].to(acc).t())).float()
    return out


def lora_expand_ref(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: tuple[torch.Tensor, ...],
    token_slots: torch.Tensor,
    *,
    add_inputs: bool = True,
    slot_ranks: torch.Tensor | None = None,
) -> torch.Tensor:
    """y: [T, sum N_s] (in place); buf: float32 [S, T, R]; lora_b: S x [L, N_s, R]."""
    token_slots = _in_range(token_slots, lora_b[0].shape[0])
    rank = lora_b[0].shape[2]
    acc = torch.float64 if y.dtype == torch.float64 else torch.float32
    if y.shape[0] * rank * max(b.shape[1] for b in lora_b) <= _BMM_MAX_ELEMENTS:
        return _expand_bmm(y, buf, lora_b, token_slots, add_inputs, slot_ranks, acc)
    for slot, idx in _groups(token_slots):
        r = _rank_of(slot, slot_ranks, rank)
        offset = 0
        for s, b in enumerate(lora_b):
            n = b.shape[1]
            delta = buf[s, idx, :r].to(acc) @ b[slot, :, :r].to(acc).t()
            cur = y[idx, offset : offset + n]
            new = cur.to(acc) + delta if add_inputs else delta
            y[idx, offset : offset + n] = new.to(y.dtype)
            offset += n
    return y


def lora_expand_stacked_ref(
    out: torch.Tensor,
    n_base: int,
    lora_b: tuple[torch.Tensor, ...],
    token_slots: torch.Tensor,
    *,
    slot_ranks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The stacked layout's expand (`kernels.lora_expand_stacked`): each row's slot
    columns of out[:, n_base:] ([T, S, L, R], slice-major) gathered into the expand's
    input, then `lora_expand_ref` into y = out[:, :n_base]. Returns y (a view of out)."""
    tokens, slices = out.shape[0], len(lora_b)
    num_slots, _, rank = lora_b[0].shape
    token_slots = _in_range(token_slots, num_slots)
    h = out[:, n_base:].reshape(tokens, slices, num_slots, rank)
    rows = torch.arange(tokens, device=out.device)
    buf = h[rows, :, token_slots.clamp(min=0).long()].permute(1, 0, 2).float()
    y = out[:, :n_base]
    lora_expand_ref(y, buf, lora_b, token_slots, slot_ranks=slot_ranks)
    return y
