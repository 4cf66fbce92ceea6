"""Pure tensor functions for segmented (Punica SGMV) LoRA: shrink and expand; the
fused mixture-of-experts layer (`fused_moe`); attention over a paged KV cache
(`paged_attention`).

`kernels` knows nothing about adapters or requests: only slots and tensors.

Semantics:
    lora_shrink(x, lora_a, token_slots, scale=1.0) -> out: float32 [S, T, R]
        for t, s: out[s, t] = scale * A_s[slot_t] @ x[t]   (0 where slot_t == -1)
    lora_expand(y, buf, lora_b, token_slots, add_inputs=True) -> y
        for t with slot_t >= 0, for s: y[t, off_s:off_s+N_s] (+)= B_s[slot_t] @ buf[s, t]
    With per-slot ranks (SegmentMeta.slot_ranks, int [L]), slot l uses only rows
    r < rank_l of A_s[l] / columns r < rank_l of B_s[l]; out[s, t, r >= rank_l] = 0.

Signatures:
    lora_shrink(x: [T, H], lora_a: tuple of S [L, R, H], token_slots: int [T] | SegmentMeta,
                *, scale: float = 1.0) -> float32 [S, T, R]
    lora_expand(y: [T, sum N_s], buf: float32 [S, T, R], lora_b: tuple of S [L, N_s, R],
                token_slots: int [T] | SegmentMeta, *, add_inputs: bool = True) -> y
    lora_shrink_expand(y, x, lora_a, lora_b, token_slots, *, scale=1.0, add_inputs=True,
                       workspace=None) -> y
    lora_expand_stacked(out: [T, N + S * L * R], n_base: N, lora_b, token_slots) -> y
                the stacked layout's expand: out = x @ [W; A_0; ...; A_{S-1}]^T (each A_s
                [L, R, H] stacked under the base weight W, slice-major), whose last
                columns are every slot's shrink; y = out[:, :N] += B_s[slot_t] @
                out[t, N + (s * L + slot_t) * R : + R] in place (the shrink in bf16 / the
                GEMM's dtype, not fp32: the layout trades that for no shrink launch)
                = lora_expand(y, lora_shrink(x, lora_a, token_slots, scale=scale), lora_b, ...)
                what the engine's LoRA layers call; optionally one fused launch
                (LORAFLEET_FUSED_MAX_TOKENS, kernels/triton/lora_fused.py)
    build_meta(token_slots: int [T], num_slots: int, slot_ranks: int [L] | None = None,
               out: SegmentMeta | None = None, max_rank: int | None = None,
               expected_slots: int | None = None) -> SegmentMeta
    SegmentMeta.empty(num_tokens, num_slots, device, block_m=None, max_rank=None,
                      expected_slots=None)
               -> SegmentMeta (preallocated; max_rank, the pool's rank, picks the tile height;
               expected_slots, the distinct slots the step is expected to hold, sizes the
               Triton kernels' tile grids at decode: a wrong guess is slower, never wrong)

S is 1 (plain), 2 (gate_up) or 3 (qkv); R <= 128 on the Triton path; x and lora_a
share a dtype (fp16/bf16/fp32); x, y and buf may have any strides; the slices of
lora_a share shape and strides, those of lora_b their rank and inner strides (a slot
pool allocated slice by slice satisfies both). Slice tensors are checked once per
set of tensors (cached): don't change their metadata in place (set_, resize_).
Pass token_slots (a tensor) and the metadata is built per call; build a SegmentMeta
once per step and pass it to every layer to build it once and to use per-slot ranks.
build_meta into a preallocated SegmentMeta (SegmentMeta.empty) runs on the device
with no host sync, so a decode step can be captured in a CUDA graph. Bad arguments
raise ValueError naming the argument. Slot values outside [-1, L) (a caller's bug,
not checked: that would need a host sync) count as -1 on every backend.

fused_moe(x, w13, w2, topk_ids, topk_weights, *, out=None) -> [T, H] (docstring below):
    y[t] = sum_{j: 0 <= e < E_local, e = topk_ids[t, j]}
               dtype(topk_weights[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])))
the experts' weighted outputs summed over the token's local choices, each cast to x's
dtype first; on Triton with no host sync (CUDA-graph capturable).

Backend: LORAFLEET_KERNELS=auto|triton|reference (auto: Triton on CUDA tensors,
reference on CPU). `triton` on CPU tensors needs TRITON_INTERPRET=1 (set before
kernels.triton is imported): the Triton interpreter, as the CPU tests run it.

Host time (eager steps: prefill, mixed, tensor-parallel): the Triton launchers memoise
their plans per host values and launch kept compiled binaries straight, past Triton's
per-call dispatch (kernels/triton/launch.py; LORAFLEET_FAST_LAUNCH=auto|0|1, auto: on for
the Triton versions tested on a GPU).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from kernels.attention_reference import paged_attention_ref
from kernels.backend import backend_for
from kernels.checks import (
    check_expand,
    check_expand_stacked,
    check_moe,
    check_paged_attention,
    check_shrink,
)
from kernels.meta import SegmentMeta, build_meta
from kernels.moe_reference import fused_moe_ref
from kernels.reference import lora_expand_ref, lora_expand_stacked_ref, lora_shrink_ref


def _split(token_slots: torch.Tensor | SegmentMeta) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(token_slots, slot_ranks) for the reference."""
    if isinstance(token_slots, SegmentMeta):
        return token_slots.token_slots, token_slots.slot_ranks
    return token_slots, None


def lora_shrink(
    x: torch.Tensor,
    lora_a: tuple[torch.Tensor, ...],
    token_slots: torch.Tensor | SegmentMeta,
    *,
    scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [T, H]; lora_a: tuple of S [L, R, H]; token_slots: int [T] or SegmentMeta -> float32 [S, T, R].

    out: optional contiguous float32 [S, T, R] buffer, ALREADY ZEROED by the caller (the
    engine zeroes one per-step workspace with a single memset instead of one per layer).
    """
    if out is not None:
        check_out(out, len(lora_a), x.shape[0], lora_a[0].shape[1], x.device)
    if backend_for(x.device) == "triton":
        from kernels.triton.lora_shrink import lora_shrink_triton

        return lora_shrink_triton(x, lora_a, token_slots, scale=scale, out=out)
    check_shrink(x, lora_a, token_slots)
    slots, ranks = _split(token_slots)
    result = lora_shrink_ref(x, lora_a, slots, scale=scale, slot_ranks=ranks)
    return result if out is None else out.copy_(result)


def check_out(out: torch.Tensor, slices: int, tokens: int, rank: int, device: torch.device) -> None:
    """Refuse a shrink output buffer of the wrong shape, dtype, layout or device."""
    want = (slices, tokens, rank)
    if (
        tuple(out.shape) != want
        or out.dtype != torch.float32
        or not out.is_contiguous()
        or out.device != device
    ):
        raise ValueError(
            f"out: {tuple(out.shape)} {out.dtype} on {out.device}; allowed: a contiguous float32 {want} on {device}"
        )


def lora_expand(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: tuple[torch.Tensor, ...],
    token_slots: torch.Tensor | SegmentMeta,
    *,
    add_inputs: bool = True,
) -> torch.Tensor:
    """y: [T, sum N_s] updated in place; buf: float32 [S, T, R]; lora_b: tuple of S [L, N_s, R]."""
    if backend_for(y.device) == "triton":
        from kernels.triton.lora_expand import lora_expand_triton

        return lora_expand_triton(y, buf, lora_b, token_slots, add_inputs=add_inputs)
    check_expand(y, buf, lora_b, token_slots)
    slots, ranks = _split(token_slots)
    return lora_expand_ref(y, buf, lora_b, slots, add_inputs=add_inputs, slot_ranks=ranks)


def lora_expand_stacked(
    out: torch.Tensor,
    n_base: int,
    lora_b: tuple[torch.Tensor, ...],
    token_slots: torch.Tensor | SegmentMeta,
) -> torch.Tensor:
    """out: [T, N + S * L * R] = x @ [W; A]^T; returns y = out[:, :N] (a view of out)
    with each row's LoRA delta added in place, read from its slot's columns of out."""
    if backend_for(out.device) == "triton":
        from kernels.triton.lora_expand import lora_expand_stacked_triton

        return lora_expand_stacked_triton(out, n_base, lora_b, token_slots)
    check_expand_stacked(out, n_base, lora_b, token_slots)
    slots, ranks = _split(token_slots)
    return lora_expand_stacked_ref(out, n_base, lora_b, slots, slot_ranks=ranks)


@functools.cache
def _triton_pair() -> SimpleNamespace:
    """The Triton launchers lora_shrink_expand calls, imported on its first call (an import
    statement in its body cost a few microseconds on every layer call)."""
    from kernels.triton import lora_fused
    from kernels.triton.lora_expand import lora_expand_triton
    from kernels.triton.lora_shrink import lora_shrink_triton, overlaps_expand

    return SimpleNamespace(
        fused=lora_fused,  # its FUSED_MAX_TOKENS is read on each call (tests and --fused set it)
        lora_shrink_expand_triton=lora_fused.lora_shrink_expand_triton,
        lora_expand_triton=lora_expand_triton,
        lora_shrink_triton=lora_shrink_triton,
        overlaps_expand=overlaps_expand,
    )


def lora_shrink_expand(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: tuple[torch.Tensor, ...],
    lora_b: tuple[torch.Tensor, ...],
    token_slots: torch.Tensor | SegmentMeta,
    *,
    scale: float = 1.0,
    add_inputs: bool = True,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """y: [T, sum N_s] updated in place with expand(shrink(x)): what a LoRA layer calls.

    Equals `lora_expand(y, lora_shrink(x, lora_a, slots, scale=scale, out=workspace),
    lora_b, slots, add_inputs=add_inputs)`, and that is how it runs by default: on the
    H200 the two launches beat the fused one-launch kernel (kernels.triton.lora_fused)
    in the engine; steps of at most lora_fused.FUSED_MAX_TOKENS tokens (env
    LORAFLEET_FUSED_MAX_TOKENS, default 0) take the fused kernel instead, which ignores
    `workspace` (a zeroed float32 [S, T, R] for the shrink output, or None).
    """
    if backend_for(y.device) == "triton":
        tri = _triton_pair()
        if x.shape[0] <= tri.fused.FUSED_MAX_TOKENS:
            return tri.lora_shrink_expand_triton(
                y, x, lora_a, lora_b, token_slots, scale=scale, add_inputs=add_inputs
            )
        # Two launches; where lora_shrink.overlaps_expand says so the expand overlaps the
        # shrink's tail (programmatic dependent launch: lora_expand_triton's after_shrink).
        if workspace is not None:
            check_out(workspace, len(lora_a), x.shape[0], lora_a[0].shape[1], x.device)
        pdl, token_slots = tri.overlaps_expand(x, lora_a, token_slots, y.shape[1])
        buf = tri.lora_shrink_triton(
            x, lora_a, token_slots, scale=scale, out=workspace, dependents=pdl
        )
        return tri.lora_expand_triton(
            y, buf, lora_b, token_slots, add_inputs=add_inputs, after_shrink=pdl
        )
    buf = lora_shrink(x, lora_a, token_slots, scale=scale, out=workspace)
    return lora_expand(y, buf, lora_b, token_slots, add_inputs=add_inputs)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One rank's experts of a mixture-of-experts layer (Mixtral's) on the tokens routed to them.

    x: [T, H] fp16/bf16/fp32 (any strides); w13: [E_local, 2I, H], expert e's gate rows
    then its up rows (transformers' gate_up_proj); w2: [E_local, H, I] (down_proj), both
    of x's dtype; topk_ids: int32/int64 [T, k], the local expert of each of a token's k
    choices, where an id outside [0, E_local) is another rank's expert and gets no work;
    topk_weights: float32 [T, k], the choices' routing weights; out: optional [T, H] of
    x's dtype to write (every row is overwritten). -> out, or a new [T, H] in x's dtype.

    Semantics:
        y[t] = 0
        for j < k with 0 <= e = topk_ids[t, j] < E_local:
            h = silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])
            y[t] += dtype(topk_weights[t, j] * (w2[e] @ h))
    Each weighted expert output is cast to x's dtype before the sum, as transformers'
    MixtralExperts (and replica.models.moe's grouped / dense paths) do; the sum itself
    accumulates in fp32 on Triton (tokens with k > 2 may differ from a sequential sum
    in x's dtype by a rounding). Triton: GEMMs accumulate in fp32 and h is rounded to
    x's dtype once, after SiLU and the product; no host sync, buffers sized by (T, k,
    E_local) only, so a decode step is captured in a CUDA graph. Reference (CPU): one
    GEMM pair per expert in x's dtype; it syncs with the host. Bad arguments raise
    ValueError naming the argument.
    """
    check_moe(x, w13, w2, topk_ids, topk_weights, out)
    if backend_for(x.device) == "triton":
        from kernels.triton.fused_moe import fused_moe_triton

        return fused_moe_triton(x, w13, w2, topk_ids, topk_weights, out)
    y = fused_moe_ref(x, w13, w2, topk_ids, topk_weights)
    return y if out is None else out.copy_(y)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens,
    *,
    scale: float,
    window: int | None = None,
    query_lens=None,
    out: torch.Tensor | None = None,
    tiles: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of queries over their sequences' keys and values in a paged KV cache.

    q: [T, heads, d] fp16/bf16/fp32; k_cache, v_cache: [blocks, block_size, kv_heads, d]
    of q's dtype (heads a multiple of kv_heads, d contiguous); block_tables: int [B, W],
    sequence i's blocks in order (key j of sequence i at cache row
    block_tables[i, j // block_size], offset j % block_size); out: optional [T, heads, d]
    to write. -> out, or a new tensor like q.

    Two layouts of the queries:
        decode (query_lens None): B == T, one query per sequence, q's row i at position
            context_lens[i] - 1, context_lens an int tensor [T] on q's device; no host
            sync, shapes from the batch only: a decode step is captured in a CUDA graph.
        chunks (query_lens a list of B ints): sequence i's query_lens[i] queries are the
            next rows of q, at positions [context_lens[i] - query_lens[i], context_lens[i]),
            context_lens a list of B ints (host values).

    Semantics, for query t of sequence i at position p, head h, kv head g = h // (heads /
    kv_heads), over keys j <= p of sequence i (and j > p - window with a sliding window):
        out[t, h] = sum_j softmax_j(scale * q[t, h] . K_i[j, g]) V_i[j, g]
    Triton reads each key and value once where it lies, in fp32 with exp2 (a flash
    attention online softmax); the reference (CPU) gathers each sequence's keys.
    tiles: Triton's prefill tiles for these query_lens (kernels.triton.paged_attention
    .prefill_tiles), where a caller keeps them for every layer of a step; tiles made with
    prefill_tiles(skip=) leave the skipped sequences' rows of out unwritten (the engine
    attends whole long prompts densely). Bad arguments raise ValueError naming the argument.
    """
    check_paged_attention(q, k_cache, v_cache, block_tables, context_lens, window, query_lens, out)
    out = torch.empty_like(q) if out is None else out
    if backend_for(q.device) == "triton":
        from kernels.triton.paged_attention import paged_attention_triton

        return paged_attention_triton(
            q, k_cache, v_cache, block_tables, context_lens, scale, window, query_lens, out, tiles
        )
    return paged_attention_ref(
        q, k_cache, v_cache, block_tables, context_lens, scale=scale, window=window,
        query_lens=query_lens, out=out,
    )  # fmt: skip


__all__ = [
    "SegmentMeta",
    "backend_for",
    "build_meta",
    "fused_moe",
    "lora_expand",
    "lora_expand_stacked",
    "lora_shrink",
    "lora_shrink_expand",
    "paged_attention",
]
