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


# ||out - oracle|| / ||oracle|| allowed for kernels.fused_moe, by dtype. 16-bit: the
# intermediate h and each weighted expert output are rounded to x's dtype (and grouped's
# reference rounds gate, up and the down output too); fp32: exact-precision dots.
MOE_TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
}


def oracle_moe(x, w13, w2, topk_ids, topk_weights) -> torch.Tensor:
    """float64 [T, H] on x's device: kernels.fused_moe's sum with no rounding, expert by
    expert (one float64 copy of one expert's weights at a time); ids outside
    [0, E_local) add nothing."""
    num_local, inter = w13.shape[0], w13.shape[1] // 2
    x64 = x.double()
    out = torch.zeros_like(x64)
    for e in range(num_local):
        hit = topk_ids == e  # [T, k]
        rows = hit.any(1).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        route = (topk_weights.double() * hit).sum(1)[rows, None]  # a repeated pick counts twice
        gate_up = x64[rows] @ w13[e].double().t()
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, rows, route * (h @ w2[e].double().t()))
    return out


def random_routing(tokens, top_k, num_local, off_frac, device, skip=()):
    """(topk_ids int64 [T, k], topk_weights float32 [T, k]), fresh: ids drawn from the
    local experts but `skip` (left with no tokens), ~off_frac of them another rank's
    (-1 - e or E_local + e); weights positive, summing to 1 per token."""
    allowed = torch.tensor([e for e in range(num_local) if e not in skip], device=device)
    ids = allowed[torch.randint(0, len(allowed), (tokens, top_k), device=device)]
    off = torch.rand(tokens, top_k, device=device) < off_frac
    other = torch.where(torch.rand(tokens, top_k, device=device) < 0.5, -1 - ids, num_local + ids)
    w = torch.rand(tokens, top_k, device=device) + 0.1
    return torch.where(off, other, ids), w / w.sum(1, keepdim=True)


def random_moe(tokens, hidden, inter, num_local, top_k, off_frac, dtype, device, skip=()):
    """(x, w13, w2, topk_ids, topk_weights), fresh values; the routing as random_routing's."""
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    w13 = (torch.randn(num_local, 2 * inter, hidden, device=device) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(num_local, hidden, inter, device=device) * inter**-0.5).to(dtype)
    ids, w = random_routing(tokens, top_k, num_local, off_frac, device, skip)
    return x, w13, w2, ids, w


def captured(step) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `step()`, run once eagerly first (Triton compiles outside the capture)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def jit_kernels() -> list:
    """Every @triton.jit kernel and FastLaunch wrapper at the top level of a kernels.triton
    module: where compiled binaries are kept in memory (`JITFunction.device_caches`,
    `FastLaunch.kept`)."""
    import importlib
    import pkgutil

    import triton

    import kernels.triton
    from kernels.triton.launch import FastLaunch

    found = []
    for info in pkgutil.iter_modules(kernels.triton.__path__):
        module = importlib.import_module(f"kernels.triton.{info.name}")
        found += [
            v
            for v in vars(module).values()
            if isinstance(v, triton.runtime.jit.JITFunction | FastLaunch)
        ]
    return found


def compiled_binaries() -> int:
    """Compiled binaries kernels.triton's JIT kernels hold in memory (0 under the CPU
    interpreter, which compiles nothing)."""
    import triton

    return sum(
        len(cache[0])
        for k in jit_kernels()
        if isinstance(k, triton.runtime.jit.JITFunction)
        for cache in k.device_caches.values()
    )
