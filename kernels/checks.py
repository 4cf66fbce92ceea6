"""Argument checks of the public calls on the torch reference backend.

The Triton launchers refuse bad arguments with a ValueError naming the argument
(kernels/triton/common.py, lora_shrink.check_x_a, lora_expand.check_y_b); the reference
ran whatever it was given, so on CPU (the reference's default device) a y one column
too wide was silently left half-updated, four slices or an int x were computed, and
a wrong length of token_slots surfaced as a bmm shape error. These checks hold the
reference to the same contract; they read only metadata (no device sync). check_moe
is kernels.fused_moe's, for both backends.
"""

from __future__ import annotations

import torch

from kernels.meta import SegmentMeta

MAX_SLICES = 3


def check_slices(
    tensors, name: str, dtypes: tuple[torch.dtype, ...] | None = None
) -> tuple[torch.Tensor, ...]:
    """tuple of 1..3 3-D float tensors of one dtype (one of dtypes when given), device and
    slot count; the Triton launchers check their slices with this too."""
    if not isinstance(tensors, tuple | list) or not 1 <= len(tensors) <= MAX_SLICES:
        raise ValueError(
            f"{name}: a tuple of 1 to {MAX_SLICES} tensors (slices); got "
            f"{type(tensors).__name__} of {len(tensors) if isinstance(tensors, tuple | list) else '?'}"
        )
    first = tensors[0]
    kinds = "a float dtype" if dtypes is None else "one of " + "/".join(map(str, dtypes))
    for s, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name}[{s}]: a 3-D tensor; got {getattr(t, 'shape', t)!r}")
        allowed = t.is_floating_point() if dtypes is None else t.dtype in dtypes
        if t.device != first.device or t.dtype != first.dtype or not allowed:
            raise ValueError(
                f"{name}[{s}] is {t.dtype} on {t.device}; allowed: {first.dtype} on "
                f"{first.device} ({kinds}, all slices alike)"
            )
        if t.shape[0] != first.shape[0]:
            raise ValueError(f"{name}[{s}]: {t.shape[0]} slots; slice 0 has {first.shape[0]}")
    return tuple(tensors)


def check_meta(meta: SegmentMeta, tokens: int, num_slots: int, device: torch.device) -> None:
    """A caller's SegmentMeta must be built for this call's T, L and device."""
    if meta.num_tokens != tokens or meta.num_slots != num_slots or meta.device != device:
        raise ValueError(
            f"token_slots (SegmentMeta): built for T={meta.num_tokens}, L={meta.num_slots} on "
            f"{meta.device}; allowed: T={tokens}, L={num_slots} on {device}"
        )


def _slots(token_slots, tokens: int, num_slots: int, device: torch.device) -> None:
    if isinstance(token_slots, SegmentMeta):
        check_meta(token_slots, tokens, num_slots, device)
        return
    if (
        not isinstance(token_slots, torch.Tensor)
        or token_slots.dtype not in (torch.int32, torch.int64)
        or tuple(token_slots.shape) != (tokens,)
        or token_slots.device != device
    ):
        raise ValueError(
            f"token_slots: {getattr(token_slots, 'dtype', type(token_slots).__name__)} "
            f"{tuple(getattr(token_slots, 'shape', ()))}; allowed: int32/int64 [{tokens}] on "
            f"{device}, or a kernels.SegmentMeta"
        )


def check_shrink(x, lora_a, token_slots) -> None:
    """x: [T, H] float; lora_a: 1..3 x [L, R, H] of x's dtype; token_slots: int [T] | meta."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x: a 2-D float tensor [T, H]; got {getattr(x, 'shape', x)!r}")
    a = check_slices(lora_a, "lora_a")
    if any(t.shape != a[0].shape for t in a):
        raise ValueError("lora_a: slices differ in shape; all slices must match")
    if a[0].dtype != x.dtype or a[0].device != x.device:
        raise ValueError(
            f"lora_a is {a[0].dtype} on {a[0].device}; allowed: x's {x.dtype} on {x.device}"
        )
    if a[0].shape[2] != x.shape[1]:
        raise ValueError(f"lora_a: H={a[0].shape[2]}; x has H={x.shape[1]}")
    _slots(token_slots, x.shape[0], a[0].shape[0], x.device)


def check_expand(y, buf, lora_b, token_slots) -> None:
    """y: [T, sum N_s] float; buf: [S, T, R]; lora_b: S x [L, N_s, R]; token_slots: int [T] | meta."""
    if not isinstance(y, torch.Tensor) or y.dim() != 2 or not y.is_floating_point():
        raise ValueError(f"y: a 2-D float tensor [T, sum N_s]; got {getattr(y, 'shape', y)!r}")
    b = check_slices(lora_b, "lora_b")
    rank = b[0].shape[2]
    if any(t.shape[2] != rank for t in b):
        raise ValueError("lora_b: slices differ in rank; all slices must match")
    if b[0].device != y.device:
        raise ValueError(f"lora_b is on {b[0].device}; allowed: y's device {y.device}")
    width = sum(t.shape[1] for t in b)
    if y.shape[1] != width:
        raise ValueError(f"y: {y.dtype} [.., {y.shape[1]}]; allowed: [T, {width}] (sum of N_s)")
    want = (len(b), y.shape[0], rank)
    if not isinstance(buf, torch.Tensor) or tuple(buf.shape) != want or buf.device != y.device:
        raise ValueError(
            f"buf: shape {tuple(getattr(buf, 'shape', ()))}; allowed: {list(want)} on {y.device}"
        )
    _slots(token_slots, y.shape[0], b[0].shape[0], y.device)


def check_expand_stacked(out, n_base, lora_b, token_slots) -> None:
    """out: [T, n_base + S * L * R] float; lora_b: S x [L, N_s, R] with sum N_s = n_base."""
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or not out.is_floating_point():
        raise ValueError(f"out: a 2-D float tensor; got {getattr(out, 'shape', out)!r}")
    b = check_slices(lora_b, "lora_b")
    num_slots, _, rank = b[0].shape
    want = n_base + len(b) * num_slots * rank
    if out.shape[1] != want or sum(t.shape[1] for t in b) != n_base:
        raise ValueError(
            f"out: [.., {out.shape[1]}] with n_base {n_base}; allowed: [T, {want}], n_base "
            "the sum of the slices' N_s"
        )
    _slots(token_slots, out.shape[0], num_slots, out.device)


def check_moe(x, w13, w2, topk_ids, topk_weights, out) -> None:
    """The `kernels.fused_moe` contract: x [T, H] float; w13 [E_local, 2I, H] and w2
    [E_local, H, I] of x's dtype; topk_ids int [T, k]; topk_weights float32 [T, k];
    out None or [T, H] of x's dtype; all on x's device."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x: a 2-D float tensor [T, H]; got {getattr(x, 'shape', x)!r}")
    tokens, hidden = x.shape
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            raise ValueError(f"{name}: a 3-D tensor; got {getattr(w, 'shape', w)!r}")
        if w.dtype != x.dtype or w.device != x.device:
            raise ValueError(
                f"{name} is {w.dtype} on {w.device}; allowed: x's {x.dtype} on {x.device}"
            )
    experts, two_i, _ = w13.shape
    inter = two_i // 2
    if two_i % 2 or w13.shape[2] != hidden:
        raise ValueError(
            f"w13: {list(w13.shape)}; allowed: [E_local, 2I, {hidden}] (gate rows, up rows)"
        )
    if tuple(w2.shape) != (experts, hidden, inter):
        raise ValueError(
            f"w2: {list(w2.shape)}; allowed: [{experts}, {hidden}, {inter}] (w13's E_local, H, I)"
        )
    routing = (
        ("topk_ids", topk_ids, (torch.int32, torch.int64)),
        ("topk_weights", topk_weights, (torch.float32,)),
    )
    for name, t, dtypes in routing:
        if (
            not isinstance(t, torch.Tensor)
            or t.dtype not in dtypes
            or t.dim() != 2
            or t.shape[0] != tokens
            or t.shape[1] < 1
            or t.device != x.device
        ):
            raise ValueError(
                f"{name}: {getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}; "
                f"allowed: {'/'.join(str(d).removeprefix('torch.') for d in dtypes)} [{tokens}, k >= 1] on {x.device}"
            )
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights: {list(topk_weights.shape)}; allowed: topk_ids' {list(topk_ids.shape)}"
        )
    if out is not None and (
        not isinstance(out, torch.Tensor)
        or tuple(out.shape) != (tokens, hidden)
        or out.dtype != x.dtype
        or out.device != x.device
    ):
        raise ValueError(
            f"out: {getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}; "
            f"allowed: {x.dtype} [{tokens}, {hidden}] on {x.device}"
        )


def check_paged_attention(
    q, k_cache, v_cache, block_tables, context_lens, window, query_lens, out
) -> None:
    """The `kernels.paged_attention` contract (see kernels/__init__.py); ValueError naming
    the argument."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.dtype not in _FLOATS:
        raise ValueError(f"q: a 3-D fp16/bf16/fp32 tensor [T, heads, d]; got {_desc(q)}")
    tokens, heads, d = q.shape
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, torch.Tensor) or c.dim() != 4:
            raise ValueError(
                f"{name}: a 4-D tensor [blocks, block_size, kv_heads, d]; got {_desc(c)}"
            )
        if c.dtype != q.dtype or c.device != q.device:
            raise ValueError(
                f"{name} is {c.dtype} on {c.device}; allowed: q's {q.dtype} on {q.device}"
            )
        if c.shape[3] != d or c.stride(3) != 1:
            raise ValueError(
                f"{name}: last dim {c.shape[3]} (stride {c.stride(3)}); allowed: q's d={d}, stride 1"
            )
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"v_cache: {list(v_cache.shape)}; allowed: k_cache's {list(k_cache.shape)}"
        )
    kv_heads = k_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(
            f"q: {heads} heads; allowed: a multiple of the caches' {kv_heads} kv_heads"
        )
    if (
        not isinstance(block_tables, torch.Tensor)
        or block_tables.dim() != 2
        or block_tables.dtype not in (torch.int32, torch.int64)
        or block_tables.device != q.device
    ):
        raise ValueError(
            f"block_tables: an int32/int64 [B, blocks] tensor on q's device; got {_desc(block_tables)}"
        )
    seqs = block_tables.shape[0]
    if query_lens is None:
        ok = (
            isinstance(context_lens, torch.Tensor)
            and context_lens.shape == (tokens,)
            and context_lens.dtype in (torch.int32, torch.int64)
            and context_lens.device == q.device
        )
        if not ok or seqs != tokens:
            raise ValueError(
                f"context_lens: decode (query_lens None) takes an int tensor [{tokens}] on q's "
                f"device and block_tables of {tokens} rows; got {_desc(context_lens)}, "
                f"{seqs} rows"
            )
    else:
        lens, ctxs = [int(n) for n in query_lens], [int(c) for c in context_lens]
        if len(lens) != seqs or len(ctxs) != seqs or sum(lens) != tokens:
            raise ValueError(
                f"query_lens / context_lens: {seqs} each (block_tables' rows), query_lens "
                f"summing to q's {tokens} rows; got {lens}, {ctxs}"
            )
        cap = block_tables.shape[1] * k_cache.shape[1]
        bad = [
            i for i, (n, c) in enumerate(zip(lens, ctxs, strict=True)) if n < 0 or c < n or c > cap
        ]
        if bad:
            raise ValueError(
                f"sequence {bad[0]}: {lens[bad[0]]} queries, context {ctxs[bad[0]]}; allowed: "
                f"0 <= queries <= context <= {cap} (the block table's width x block_size)"
            )
    if window is not None and int(window) < 1:
        raise ValueError(f"window: a positive int or None; got {window!r}")
    if out is not None and (
        not isinstance(out, torch.Tensor)
        or out.shape != q.shape
        or out.dtype != q.dtype
        or out.device != q.device
        or out.stride(2) != 1
    ):
        raise ValueError(
            f"out: {_desc(out)}; allowed: q's shape, dtype and device, last dim stride 1"
        )


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _desc(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {list(t.shape)} on {t.device}"
    return repr(t)
