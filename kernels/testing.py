"""Oracle and tolerances for validating the kernels (used by tests and the benchmark).

The oracle is a dense float64 per-token computation, independent of the reference's
grouping: out64[s, t] = scale * A_s[slot_t, :rank] @ x[t].
"""

from __future__ import annotations

import torch

# ||out - ref|| / ||ref|| allowed, keyed by input dtype. fp32: Triton's dot on CUDA
# uses tf32; 16-bit: operands rounded to fp16/bf16, output rounded to y's dtype.
TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 2e-3,
    torch.float16: 5e-3,
    torch.bfloat16: 2e-2,
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN anywhere -> inf)."""
    out64, ref64 = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out64).all():
        return float("inf")
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def rank_mask(
    token_slots: torch.Tensor, slot_ranks: torch.Tensor | None, rank: int
) -> torch.Tensor:
    """float64 [T, R]: 1 where r < rank of the token's slot, 0 elsewhere and for slot -1."""
    slots = token_slots.long().cpu()
    ranks = (
        torch.full((int(slots.max().clamp_min(0)) + 1,), rank)
        if slot_ranks is None
        else slot_ranks.long().cpu()
    )
    per_tok = torch.where(slots >= 0, ranks[slots.clamp_min(0)].clamp(max=rank), 0)
    return (torch.arange(rank)[None, :] < per_tok[:, None]).double()


def oracle_shrink(x, lora_a, token_slots, scale=1.0, slot_ranks=None) -> torch.Tensor:
    """float64 [S, T, R] on the CPU."""
    slots = token_slots.long().cpu()
    mask = rank_mask(slots, slot_ranks, lora_a[0].shape[1])
    x64 = x.double().cpu()
    outs = []
    for a in lora_a:
        a_tok = a.double().cpu()[slots.clamp_min(0)]  # [T, R, H]
        outs.append(scale * torch.einsum("trh,th->tr", a_tok, x64) * mask)
    return torch.stack(outs)


def oracle_expand(y, buf, lora_b, token_slots, add_inputs=True, slot_ranks=None) -> torch.Tensor:
    """float64 [T, sum N_s] on the CPU: the expected y after the call."""
    slots = token_slots.long().cpu()
    mask = rank_mask(slots, slot_ranks, lora_b[0].shape[2])
    live = (slots >= 0)[:, None]
    y64 = y.double().cpu()
    parts, off = [], 0
    for s, b in enumerate(lora_b):
        n = b.shape[1]
        b_tok = b.double().cpu()[slots.clamp_min(0)]  # [T, N, R]
        h = torch.where(mask > 0, buf[s].double().cpu(), 0.0)  # garbage past a rank: ignored
        delta = torch.einsum("tnr,tr->tn", b_tok, h)
        base = y64[:, off : off + n]
        new = base + delta if add_inputs else delta
        parts.append(torch.where(live, new, base))
        off += n
    return torch.cat(parts, dim=1)


def random_slots(
    tokens: int, num_slots: int, distinct: int, none_frac: float, gen=None
) -> torch.Tensor:
    """int64 [T]: `distinct` slots drawn from [0, L) shuffled over the tokens, ~none_frac of them -1."""
    chosen = torch.randperm(num_slots, generator=gen)[:distinct]
    slots = chosen[torch.randint(0, distinct, (tokens,), generator=gen)]
    slots[: min(distinct, tokens)] = chosen[: min(distinct, tokens)]  # every chosen slot present
    none = torch.rand(tokens, generator=gen) < none_frac
    slots = torch.where(none, -1, slots)
    return slots[torch.randperm(tokens, generator=gen)]


def random_slices(num_slots: int, dims: list[tuple[int, int]], dtype, device, std: float) -> tuple:
    """tuple of S [L, d0, d1] tensors, fresh normal values * std."""
    return tuple((torch.randn(num_slots, d0, d1, device=device) * std).to(dtype) for d0, d1 in dims)


def rank_major(lora_b: tuple) -> tuple:
    """The same B slices [L, N_s, R] stored rank-major ([L, R, N_s] memory, transposed
    view), as lora_core.slot_buffers keeps them: n-stride 1, r-stride N_s (differs by slice)."""
    return tuple(b.transpose(1, 2).contiguous().transpose(1, 2) for b in lora_b)


def slot_map(tokens, num_slots, none_frac, bad_frac, dtype, seed, device="cpu") -> torch.Tensor:
    """[T] slots in [0, L), ~none_frac of them -1 and ~bad_frac out of range (<= -2 or >= L)."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, num_slots, (tokens,), generator=gen)
    u = torch.rand(tokens, generator=gen)
    bad = torch.where(torch.rand(tokens, generator=gen) < 0.5, -2 - slots, num_slots + slots)
    slots = torch.where(u < none_frac, -1, torch.where(u < none_frac + bad_frac, bad, slots))
    return slots.to(dtype).to(device)


def captured(step) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `step()`, run once eagerly first (Triton compiles outside the capture)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph
