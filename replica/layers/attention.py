"""Attention over a paged KV cache: kernels.paged_attention's Triton kernel on CUDA (the
cache read in place), this module's torch implementation on CPU (and with
LORAFLEET_KERNELS=reference).

KV cache layout per layer: k_cache, v_cache: [num_blocks, block_size, kv_heads, d].
A token's KV lives at flat slot `block * block_size + offset`; a sequence's
block table lists its blocks in order.

Example (block_size 4): a sequence with block table [7, 2] and 6 tokens keeps
tokens 0-3 in block 7 (slots 28..31) and tokens 4-5 in block 2 (slots 8, 9).

The batch is laid out decode tokens first (one per sequence), then prefill chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import kernels
from kernels.attention_reference import attend_sequence, visible_keys
from kernels.backend import backend_for
from replica.config import DENSE_PROMPT_MIN


@dataclass
class PrefillChunk:
    """One sequence's prefill chunk: tokens [start, start+q_len) of the batch.

    context_len: tokens of the sequence whose KV exists after this step (cached + chunk).
    block_table: long [num_blocks] of this sequence.
    """

    start: int
    q_len: int
    context_len: int
    block_table: torch.Tensor


@dataclass
class AttentionMetadata:
    """Per-step attention inputs.

    slot_mapping: long [T] flat KV slot of each batch token.
    num_decode: the first num_decode tokens are decode tokens, one per sequence.
    decode_block_tables: long [num_decode, max_blocks] (padded with 0).
    decode_context_lens: long [num_decode] KV length of each decode sequence, this token included.
    prefills: the prefill chunks that follow the decode tokens.
    dense_prompt_min: on the Triton path, whole prompts of this many tokens or more
        attend through dense SDPA (EngineConfig.dense_prompt_min; 0: none).
    """

    slot_mapping: torch.Tensor
    num_decode: int
    decode_block_tables: torch.Tensor | None
    decode_context_lens: torch.Tensor | None
    prefills: list[PrefillChunk]
    dense_prompt_min: int = DENSE_PROMPT_MIN
    step_cache: dict = field(default_factory=dict, repr=False, compare=False)
    """What every layer of the step would make alike (the torch path's attention masks
    per sliding window; the Triton path's chunk tables and query tiles), made by the
    first layer that needs it and reused by the others: it follows the step, not the layer."""

    def per_step(self, key: tuple, make: Callable):
        """What `key` names, from make() the first time it is asked for."""
        m = self.step_cache.get(key)
        if m is None:
            m = self.step_cache[key] = make()
        return m


def write_kv(
    k_cache, v_cache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, kv_heads, d] stored at their flat slots."""
    nb, bs, kvh, d = k_cache.shape
    k_cache.view(nb * bs, kvh, d).index_copy_(0, slot_mapping, k)
    v_cache.view(nb * bs, kvh, d).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """block_table: long [..., nb] -> [..., nb * block_size, kv_heads, d]."""
    g = cache[block_table]
    return g.flatten(-4, -3)


def decode_attention(
    q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None
):
    """q: [D, heads, d] -> [D, heads, d]; each query sits at position context_len - 1."""
    keys = _gather(k_cache, meta.decode_block_tables).transpose(1, 2)  # [D, kvh, S, d]
    vals = _gather(v_cache, meta.decode_block_tables).transpose(1, 2)

    def make():
        pos = torch.arange(keys.shape[2], device=q.device)
        last = meta.decode_context_lens[:, None] - 1
        valid = pos[None, :] <= last
        if window is not None:
            valid &= pos[None, :] > last - window
        return valid[:, None, None, :]

    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None, :],
        keys,
        vals,
        attn_mask=meta.per_step(("decode", window), make),
        scale=scale,
        enable_gqa=True,
    )
    return out[:, :, 0, :]


def paged_attention(
    q,
    k,
    v,
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    out: torch.Tensor | None = None,
):
    """q: [T, heads, d]; k, v: [T, kv_heads, d] (new tokens) -> [T, heads, d], written
    into `out` where given (a CUDA graph's static buffer: `replica.mixed_graphs`)."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q) if out is None else out
    if backend_for(q.device) == "triton":
        return _paged_kernel(q, k, v, k_cache, v_cache, meta, scale, window, out)
    nd = meta.num_decode
    if nd:
        out[:nd] = decode_attention(q[:nd], k_cache, v_cache, meta, scale, window)
    for i, chunk in enumerate(meta.prefills):
        s = slice(chunk.start, chunk.start + chunk.q_len)
        make = lambda c=chunk: visible_keys(c.q_len, c.context_len, window, q.device)  # noqa: E731
        mask = meta.per_step(("prefill", i, window), make)
        ctx, table = chunk.context_len, chunk.block_table
        out[s] = attend_sequence(q[s], k_cache, v_cache, table, ctx, scale, window, mask)
    return out


def _paged_kernel(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale, window, out):
    """paged_attention through kernels.paged_attention: one launch for the decode tokens
    and one for the prompt chunks, whose block tables and query tiles the step's first
    layer builds for all of them; whole long prompts (meta.dense_prompt_min) through dense
    causal SDPA on their own k / v instead, their tiles left out of the launch."""
    nd = meta.num_decode
    if nd:
        kernels.paged_attention(
            q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
            scale=scale, window=window, out=out[:nd],
        )  # fmt: skip
    if meta.prefills:
        from kernels.triton.paged_attention import tile_shape

        block_q = tile_shape(q.shape[1] // k_cache.shape[2], q.dtype, q.shape[2], False).block_q
        tables, ctxs, lens, tiles, dense = meta.per_step(
            ("chunks", block_q, window), lambda: _chunks(meta, block_q, window)
        )
        for s in dense:
            out[s] = _dense_prompt(q[s], k[s], v[s], scale)
        if tiles.shape[0]:
            rows = slice(nd, nd + sum(lens))
            kernels.paged_attention(
                q[rows], k_cache, v_cache, tables, ctxs, scale=scale, window=window,
                query_lens=lens, out=out[rows], tiles=tiles,
            )  # fmt: skip
    return out


def _dense_prompt(q, k, v, scale: float) -> torch.Tensor:
    """q [n, heads, d], k, v [n, kv_heads, d]: a prompt's queries, keys and values, none
    cached before -> [n, heads, d], causal attention (SDPA's fastest kernel for the shape).

    16-bit inputs share each KV head among its query heads (enable_gqa: FlashAttention
    on CUDA). Other dtypes get the KV heads repeated instead: FlashAttention has no
    float32 kernel, and with enable_gqa the memory-efficient one is passed over too,
    leaving the math backend and its [heads, n, n] score matrix (8.6 GB in float32 for
    32 heads at 8192 tokens); with equal heads the memory-efficient kernel can run."""
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
    gqa = q.dtype in (torch.float16, torch.bfloat16)
    if not gqa and k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    o = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=gqa
    )
    return o[0].transpose(0, 1)


def _chunks(meta: AttentionMetadata, block_q: int, window: int | None):
    """(block tables [chunks, widest], context lengths, query counts, Triton query tiles
    of block_q queries, the rows of the chunks that go dense) of the step's prompt chunks,
    which follow the decode tokens one after another. A chunk goes dense where it is a
    whole prompt (no cached keys) of meta.dense_prompt_min queries or more that the sliding
    window, if any, does not cut; the tiles leave its queries out."""
    from kernels.triton.paged_attention import prefill_tiles

    start, least = meta.num_decode, meta.dense_prompt_min
    go_dense = []
    for c in meta.prefills:
        if c.start != start:
            raise ValueError(
                f"prompt chunks must follow each other from row {start}; one starts at {c.start}"
            )
        whole = c.context_len == c.q_len and (window is None or c.q_len <= window)
        go_dense.append(whole and 0 < least <= c.q_len)
        start += c.q_len
    tables = meta.per_step(  # one copy for every window of the step's layers
        ("chunk tables",),
        lambda: torch.nn.utils.rnn.pad_sequence(
            [c.block_table for c in meta.prefills], batch_first=True
        ),
    )
    ctxs = [c.context_len for c in meta.prefills]
    lens = [c.q_len for c in meta.prefills]
    pairs = zip(meta.prefills, go_dense, strict=True)
    dense = [slice(c.start, c.start + c.q_len) for c, d in pairs if d]
    device = meta.prefills[0].block_table.device
    tiles = prefill_tiles(lens, ctxs, block_q, device, skip=go_dense)
    return tables, ctxs, lens, tiles, dense
