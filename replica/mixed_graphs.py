"""Prefill and mixed steps replayed from CUDA graphs of each layer's token-count work,
with attention run eagerly between them (piecewise CUDA graphs).

A step that carries a prompt chunk cannot replay a whole-step graph: its attention's work
follows its sequences (how many chunks, how long, over how much context), not only its
token count. Everything else in a layer follows the token count alone: the norms, the
qkv / o / MLP GEMMs and their LoRA kernels, RoPE, the residual adds. So a step of T
tokens runs the L + 1 graphs captured for the smallest token bucket >= T, and each
layer's attention eagerly between them, on the T real tokens:

    graph 0:      embedding, RoPE table, LoRA metadata; layer 0's norm, qkv (+ LoRA), RoPE
    attention 0   (eager: KV written, decode and prompt-chunk attention)
    graph i:      layer i-1's o_proj + MLP (+ LoRA) and residual adds; layer i's norm, qkv, RoPE
    ...
    graph L:      layer L-1's o_proj + MLP, the final norm -> hidden states

Why: an eager step costs its host time, not its GPU time, where the host time is larger.
On an H100 host a 32-layer step launches ~2000 kernels (28-30 ms base-only, against
15 ms of GPU work at 128 decode tokens), and each of its 224 LoRA layer calls ~70 us more
(`benchmarks/README.md`, eager steps). Replayed, a layer's work costs one graph launch;
what stays eager is attention, whose launches are few.

The graphs read and write static buffers sized for the largest bucket (token ids,
positions, LoRA slots, the residual stream x, q, k, v, the attention output, hidden);
a bucket uses their first rows. Rows past T are padding: token 0 at position 0 with LoRA
slot -1. Every row's work in a graph is its own (norms, GEMM rows, LoRA for slot -1 adds
nothing, a mixture-of-experts block routes each token alone) and attention never sees
the padding, so padding writes no KV and cannot change a real row.

Example: a step of 100 decode tokens and one 300-token prompt chunk (T = 400) replays the
512-token graphs; attention runs on rows 0-399; rows 400-511 are padding.

Keys are (token bucket, LoRA key): the LoRA key is 0 for a step without adapters, else
the slot bucket the kernels size their tile grids for (`replica.cuda_graphs.lora_key`).
Graphs are captured lazily, on a key's first step (after one eager warm-up of its pieces
that compiles the Triton kernels), into one shared memory pool. A capture that fails
turns these graphs off (steps run eagerly) and says so in the log.

Without `capture` (CPU) the pieces run as plain calls over the same buffers: the padding
and buffer hand-offs are then testable on CPU, token for token against the eager model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from replica.cuda_graphs import buckets, lora_key, lora_keys, num_slots, warm_up

log = logging.getLogger(__name__)

MAX_TOKENS = 2048
"""The largest step (tokens) replayed. Above it a step's GPU time exceeds its host time
(an 8B model's 2048-token step computes ~33 TFLOP) and graphs would only hold memory:
each bucket's captured temporaries stay in the graphs' pool."""

FIRST_BUCKETS = (8, 16, 32, 64, 96, 128, 192, 256, *range(320, 1025, 64), *range(1152, 2048, 128))
"""Token buckets below MAX_TOKENS. Small steps are host-bound, so padding them costs
little; larger steps pay for their padding rows in GPU time (an H100 ran a 640-token step
padded to 768 4% slower than eagerly), so above 256 tokens a bucket adds at most 64 rows
(128 above 1024)."""


class MixedGraphs:
    """Replays steps of up to max_tokens tokens of `model` (a `CausalLM`, tensor
    parallelism off) piecewise; see the module docstring."""

    def __init__(self, model, kv_caches, lora_ctx, max_tokens: int, capture: bool = True):
        decoder = model.model
        self.decoder = decoder
        self.layers = list(decoder.layers)
        self.kv_caches = kv_caches
        self.lora_ctx = lora_ctx
        self.capture = capture
        if lora_ctx is not None:
            max_tokens = min(max_tokens, lora_ctx.max_num_tokens)
        self.token_buckets = buckets(min(max_tokens, MAX_TOKENS), FIRST_BUCKETS)
        self.num_slots = num_slots(lora_ctx)
        n = self.token_buckets[-1]
        attn = self.layers[0].self_attn
        weight = decoder.embed_tokens.weight
        act = dict(dtype=weight.dtype, device=weight.device)
        long = dict(dtype=torch.long, device=weight.device)
        d = attn.head_dim
        self.input_ids = torch.zeros(n, **long)
        self.positions = torch.zeros(n, **long)
        self.lora_slots = torch.full((n,), -1, **long)
        self.x = torch.zeros(n, weight.shape[1], **act)
        self.cos = torch.zeros(n, 1, d, **act)
        self.sin = torch.zeros(n, 1, d, **act)
        self.q = torch.zeros(n, attn.num_heads, d, **act)
        self.k = torch.zeros(n, attn.num_kv_heads, d, **act)
        self.v = torch.zeros(n, attn.num_kv_heads, d, **act)
        self.attn = torch.zeros(n, attn.num_heads, d, **act)
        self.hidden = torch.zeros(n, weight.shape[1], **act)
        self.pool = None  # one memory pool for every graph, made at the first capture
        self._pieces: dict[tuple[int, int], list[Callable[[], None]]] = {}
        self.disabled = False
        self.replays = 0

    def key_for(self, num_tokens: int, lora_count: int) -> tuple[int, int] | None:
        """(token bucket, LoRA key) of a step of num_tokens tokens holding lora_count
        distinct adapters, or None if no graphs can take it."""
        if self.disabled or not 0 < num_tokens <= self.token_buckets[-1]:
            return None
        b = next(x for x in self.token_buckets if x >= num_tokens)
        return b, lora_key(self.lora_ctx, self.num_slots, b, lora_count)

    def compile_keys(self) -> list[tuple[int, int]]:
        """Every key a step can have: each token bucket with each of its LoRA keys."""
        return [
            (n, s) for n in self.token_buckets for s in lora_keys(self.lora_ctx, self.num_slots, n)
        ]

    @torch.inference_mode()
    def warm(self) -> int:
        """Run every key's pieces once, eagerly and uncaptured, on padding rows (row 0 on
        LoRA slot 0 where the key has adapters), as a capture's warm-up does: every Triton
        kernel variant the pieces can launch is compiled (or loaded from Triton's disk
        cache) now, not in the first step of its key. The pieces write no KV (attention
        is not among them; its variants are compiled on their own). -> the keys run."""
        keys = self.compile_keys()
        for n, slots in keys:
            self._prime(n, slots)
            for call in self._pieces_of(n, slots):
                call()
        return len(keys)

    @torch.inference_mode()
    def run(self, key: tuple[int, int], batch) -> torch.Tensor | None:
        """Hidden states [T, H] of the step `batch` (a `StepBatch`, KV written), or None if
        the capture failed. The result is a view of a static buffer: valid until the next
        step."""
        pieces = self._pieces.get(key)
        if pieces is None:
            pieces = self._capture(key)
            if pieces is None:
                return None
        n, t = key[0], batch.input_ids.shape[0]
        self.input_ids[:t].copy_(batch.input_ids)
        self.positions[:t].copy_(batch.positions)
        self.lora_slots[:t].copy_(batch.lora_slots)
        self._pad(t, n)
        q, k, v, out = self.q[:t], self.k[:t], self.v[:t], self.attn[:t]
        for i, (layer, kv) in enumerate(zip(self.layers, self.kv_caches, strict=True)):
            pieces[i]()
            layer.self_attn.attend(q, k, v, kv, batch.meta, out=out)
        pieces[-1]()
        self.replays += 1
        return self.hidden[:t]

    def _pad(self, t: int, n: int) -> None:
        self.input_ids[t:n].zero_()
        self.positions[t:n].zero_()
        self.lora_slots[t:n].fill_(-1)

    def _prime(self, n: int, slots: int) -> None:
        """The n-token bucket's rows all padding, row 0 on LoRA slot 0 where the key has
        adapters (warm-up and capture take the LoRA path)."""
        self._pad(0, n)
        if slots:
            self.lora_slots[0] = 0

    def _piece(self, i: int, n: int, slots: int) -> None:
        """Graph i of the n-token bucket (see the module docstring)."""
        rows = slice(0, n)
        if i == 0:
            if self.lora_ctx is not None:
                self.lora_ctx.set(self.lora_slots[rows], slots > 0, slots or None)
            x = self.decoder.embed_tokens(self.input_ids[rows])
            cos, sin = self.decoder.rotary.table(self.positions[rows], x.dtype)
            self.cos[rows].copy_(cos)
            self.sin[rows].copy_(sin)
        else:
            x = self.layers[i - 1].finish(self.x[rows], self.attn[rows])
        if i == len(self.layers):
            self.hidden[rows].copy_(self.decoder.norm(x))
            return
        self.x[rows].copy_(x)
        q, k, v = self.layers[i].project(x, (self.cos[rows], self.sin[rows]))
        self.q[rows].copy_(q)
        self.k[rows].copy_(k)
        self.v[rows].copy_(v)

    def _pieces_of(self, n: int, slots: int) -> list[Callable[[], None]]:
        return [(lambda i=i: self._piece(i, n, slots)) for i in range(len(self.layers) + 1)]

    @torch.inference_mode()
    def _capture(self, key: tuple[int, int]) -> list[Callable[[], None]] | None:
        n, slots = key
        calls = self._pieces_of(n, slots)
        if not self.capture:
            self._pieces[key] = calls
            return calls
        self._prime(n, slots)
        start = time.perf_counter()
        try:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            warm_up(lambda: [call() for call in calls])
            graphs = []
            for call in calls:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    call()
                graphs.append(g)
        except RuntimeError as e:
            log.warning("CUDA graph capture failed for %s (%s); such steps run eagerly", key, e)
            self.disabled = True
            return None
        pieces = [g.replay for g in graphs]
        self._pieces[key] = pieces
        log.info(
            "captured %d layer graphs for %d-token steps (LoRA key %d) in %.0f ms",
            len(graphs), n, slots, (time.perf_counter() - start) * 1e3,
        )  # fmt: skip
        return pieces
