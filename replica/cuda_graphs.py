"""Decode steps replayed from CUDA graphs, so a step costs its GPU time, not the host's
hundreds of kernel launches (every layer's GEMMs, attention and LoRA kernels).

A decode-only step of B sequences replays the graph captured for the smallest batch
bucket >= B and KV-width bucket (blocks per sequence) >= the longest block table.
Inputs live in static tensors; rows past B are padding that reads and writes only a
scratch KV block the block manager never hands out, with LoRA slot -1 (no adapter
work) and logits that are ignored. Padding is rewritten before every replay, so a
row left over from a larger earlier batch can never write into a live sequence's KV.

Example: B = 5 real sequences, buckets (1, 2, 4, 8, ...): the 8-row graph runs; rows 5-7
carry slot_mapping = scratch * block_size, context_len 1, block table [scratch, ...].
Graphs are captured lazily on first use (after one eager warm-up run that compiles the
Triton kernels) into one shared memory pool.

The key's third part is the step's distinct adapters rounded up to a slot bucket (0 = no
adapter: the LoRA kernels are skipped): the graph's LoRA kernels size their tile grids
for that many slots (kernels.SegmentMeta.expected_slots) instead of all L, so a step of
128 sequences over 3 adapters launches no programs for the 61 tiles 64 slots could add.
Where the kernels keep the grid for all slots (prefill-sized tiles:
LoraBatchContext.grid_follows_expected_slots) every count shares one graph.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from replica.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)


SLOT_BUCKET_GROWTH = 2
"""Slot buckets 1, 2, 4, ... up to L: each step's graph expects under twice its distinct
adapters (a few captures per batch size, not one per count)."""


def slot_bucket(count: int, limit: int) -> int:
    """Distinct adapters `count` (>= 1) rounded up to a slot bucket, at most `limit`."""
    b = 1
    while b < count:
        b *= SLOT_BUCKET_GROWTH
    return min(b, limit)


def num_slots(lora_ctx) -> int:
    """The adapter slots a LoRA context's kernels can see (no bound without a pool)."""
    ranks = getattr(lora_ctx, "slot_ranks", None)
    return ranks.shape[0] if ranks is not None else 1 << 30


def lora_key(lora_ctx, slots: int, tokens: int, lora_count: int) -> int:
    """The LoRA part of a graph's key, for a step padded to `tokens` rows whose tokens hold
    lora_count distinct adapters of a pool of `slots`: 0 (no adapter: the LoRA kernels
    are skipped), else the slot bucket the graph's kernels size their grids for."""
    limit = min(tokens, slots)
    if not lora_count:
        return 0
    if lora_ctx is None or not lora_ctx.grid_follows_expected_slots(tokens):
        return limit  # the kernels ignore the expectation: one graph for any count
    return slot_bucket(lora_count, limit)


def lora_keys(lora_ctx, slots: int, tokens: int) -> list[int]:
    """Every LoRA key a graph of `tokens` rows can have (lora_key over 0 to min(tokens,
    slots) distinct adapters), ascending."""
    return sorted({lora_key(lora_ctx, slots, tokens, c) for c in range(min(tokens, slots) + 1)})


def warm_up(run: Callable[[], object]) -> None:
    """run() once on a side stream before capturing it: its Triton kernels compile outside
    the capture; the current stream then waits for it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)


def buckets(limit: int, first: tuple[int, ...]) -> list[int]:
    out = [b for b in first if b < limit]
    while not out or out[-1] < limit:
        out.append(min(limit, out[-1] * 2 if out else 1))
    return out


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    lora_slots: torch.Tensor
    logits: torch.Tensor


class DecodeGraphs:
    def __init__(
        self,
        model,
        kv_caches,
        block_size: int,
        lora_ctx,
        scratch_block: int,
        max_batch: int,
        max_blocks: int,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.lora_ctx = lora_ctx
        self.scratch = scratch_block
        if lora_ctx is not None:
            # A graph's rows are one step's tokens, which the LoRA context must hold: with
            # max_num_batched_tokens below max_num_seqs a larger bucket failed its capture
            # with a ValueError (not caught there), failing the step and all its requests.
            max_batch = min(max_batch, lora_ctx.max_num_tokens)
        self.batch_buckets = buckets(max_batch, (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128))
        self.width_buckets = buckets(max_blocks, (1, 2, 4, 8, 16, 32))
        self.device = kv_caches[0][0].device
        self.pool = None  # one memory pool for every graph, made at the first capture
        self._graphs: dict[tuple[int, int, int], _Graph] = {}
        self.num_slots = num_slots(lora_ctx)
        self.disabled = False
        self.replays = 0

    def key_for(self, num_decode: int, width: int, lora_count: int) -> tuple[int, int, int] | None:
        """(batch bucket, width bucket, slot bucket) of a decode-only step whose tokens
        hold lora_count distinct adapters, or None if no graph can take it."""
        if self.disabled or num_decode > self.batch_buckets[-1] or width > self.width_buckets[-1]:
            return None
        b = next(x for x in self.batch_buckets if x >= num_decode)
        w = next(x for x in self.width_buckets if x >= width)
        return b, w, lora_key(self.lora_ctx, self.num_slots, b, lora_count)

    def compile_keys(self) -> list[tuple[int, int, int]]:
        """One key per (batch bucket, LoRA key) pair, at the narrowest width: a graph's
        Triton kernels other than attention's follow its rows and LoRA key alone, and the
        attention kernel's variants are compiled at engine start on their own
        (`kernels.triton.paged_attention.warm_up`)."""
        w = self.width_buckets[0]
        return [
            (b, w, s)
            for b in self.batch_buckets
            for s in lora_keys(self.lora_ctx, self.num_slots, b)
        ]

    @torch.inference_mode()
    def warm(self) -> int:
        """Run each of compile_keys()'s forwards once, eagerly and uncaptured, on padding
        rows (the scratch KV block, LoRA slot 0 or -1): every Triton kernel variant a
        decode graph can launch is compiled (or loaded from Triton's disk cache) now, not
        in the first step to capture its key, a stall of ~1-2 s a compile on a cold
        cache. Nothing but the scratch block is written. -> the keys run."""
        keys = self.compile_keys()
        for key in keys:
            self._forward(self._buffers(key), key[2])
        return len(keys)

    def run(self, key: tuple[int, int, int], batch) -> torch.Tensor | None:
        """Logits [num_decode, V] of a decode-only batch, or None if capture failed."""
        g = self._graphs.get(key)
        if g is None:
            g = self._capture(key)
            if g is None:
                return None
        n = batch.meta.num_decode
        tables = batch.meta.decode_block_tables
        g.input_ids[:n].copy_(batch.input_ids)
        g.positions[:n].copy_(batch.positions)
        g.slot_mapping[:n].copy_(batch.meta.slot_mapping)
        g.context_lens[:n].copy_(batch.meta.decode_context_lens)
        g.block_tables[:n, : tables.shape[1]].copy_(tables)
        g.block_tables[:n, tables.shape[1] :].fill_(self.scratch)
        g.lora_slots[:n].copy_(batch.lora_slots)
        self._pad(g, n)
        g.graph.replay()
        self.replays += 1
        return g.logits[:n]

    def _pad(self, g: _Graph, n: int) -> None:
        g.input_ids[n:].zero_()
        g.positions[n:].zero_()
        g.slot_mapping[n:].fill_(self.scratch * self.block_size)
        g.context_lens[n:].fill_(1)
        g.block_tables[n:].fill_(self.scratch)
        g.lora_slots[n:].fill_(-1)

    def _forward(self, g: _Graph, slots: int) -> torch.Tensor:
        meta = AttentionMetadata(
            g.slot_mapping, g.input_ids.shape[0], g.block_tables, g.context_lens, []
        )
        if self.lora_ctx is not None:
            self.lora_ctx.set(g.lora_slots, slots > 0, slots or None)
        hidden = self.model(g.input_ids, g.positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    def _buffers(self, key: tuple[int, int, int]) -> _Graph:
        """Static inputs for key, every row padding (row 0 on LoRA slot 0 when the key has
        adapters: warm-up and capture take the LoRA path); the graph not yet captured."""
        b, w, slots = key
        long = dict(dtype=torch.long, device=self.device)
        g = _Graph(
            graph=None,
            input_ids=torch.zeros(b, **long),
            positions=torch.zeros(b, **long),
            slot_mapping=torch.full((b,), self.scratch * self.block_size, **long),
            block_tables=torch.full((b, w), self.scratch, **long),
            context_lens=torch.ones(b, **long),
            lora_slots=torch.full((b,), -1, **long),
            logits=torch.empty(0),
        )
        if slots:
            g.lora_slots[0] = 0
        return g

    @torch.inference_mode()
    def _capture(self, key: tuple[int, int, int]) -> _Graph | None:
        slots = key[2]
        g = self._buffers(key)
        g.graph = torch.cuda.CUDAGraph()
        try:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            warm_up(lambda: self._forward(g, slots))
            with torch.cuda.graph(g.graph, pool=self.pool):
                g.logits = self._forward(g, slots)
        except RuntimeError as e:
            log.warning("CUDA graph capture failed for %s (%s); decode runs eagerly", key, e)
            self.disabled = True
            return None
        self._graphs[key] = g
        return g
