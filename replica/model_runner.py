"""Builds one step's flattened batch, runs the model, returns logits of sampling rows.

Layout of a step with decode sequences d0, d1 and a prefill chunk p (3 tokens):
    tokens:     [d0, d1, p0, p1, p2]
    positions:  [n_d0 - 1, n_d1 - 1, c, c + 1, c + 2]   (c = p's cached tokens)
    lora slots: [slot(d0), slot(d1), slot(p) x 3]     (-1 for base-model requests)
    sample rows: 0, 1 and 4 if p's chunk ends its known tokens, else 0, 1.
    prompt rows: 2, 3, 4 (the positions whose logits score p's prompt tokens c + 1 ..
        c + 3, `replica.prompt_logprobs`) if p asks for prompt logprobs and none of them
        is scored yet; 4 only if p's prompt ends at c + 3 (no token follows it).
A sequence with max_tokens 0 whose chunk ends its prompt has no sample row: it is `done`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from replica.config import DENSE_PROMPT_MIN
from replica.layers.attention import AttentionMetadata, PrefillChunk
from replica.models.llama import CausalLM
from replica.outputs import TopLogprobs
from replica.prompt_logprobs import positions_to_score, score_chunks, score_rows
from replica.sequence import Sequence


@dataclass
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    lora_slots: torch.Tensor
    lora_count: int
    """Distinct adapters (slots >= 0) among the step's tokens."""
    meta: AttentionMetadata
    sample_rows: torch.Tensor
    sample_seqs: list[Sequence]
    prompt_rows: torch.Tensor | None = None
    """long [m]: rows whose logits score prompt tokens (None: no sequence asks)."""
    prompt_targets: torch.Tensor | None = None
    """long [m]: the prompt token each prompt row scores."""
    prompt_seqs: list[tuple[Sequence, int]] = field(default_factory=list)
    """(sequence, its count of prompt rows), in row order."""
    done: list[Sequence] = field(default_factory=list)
    """Sequences with max_tokens 0 whose prompt this step completes (nothing to sample)."""

    @property
    def any_lora(self) -> bool:
        return self.lora_count > 0


@dataclass
class StepLogits:
    """What one step's forward returns to the engine.

    logits: float32 [len(sample_seqs), V].
    prompt: per `prompt_seqs` entry, (logprobs of the prompt tokens it scored, their ranks,
        their top tokens: as many as the sequence's params.prompt_logprobs, [] for 0).
    """

    logits: torch.Tensor
    prompt: list[tuple[list[float], list[int], list[TopLogprobs]]] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        lora_ctx=None,
        graphs=None,
        mixed=None,
        dense_prompt_min: int = DENSE_PROMPT_MIN,
    ):
        """graphs: a `replica.cuda_graphs.DecodeGraphs` to replay decode-only steps, or None;
        mixed: a `replica.mixed_graphs.MixedGraphs` to replay the other steps' layers
        around eager attention, or None; dense_prompt_min: EngineConfig.dense_prompt_min,
        set on each step's AttentionMetadata."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.lora_ctx = lora_ctx
        self.graphs = graphs
        self.mixed = mixed
        self.dense_prompt_min = dense_prompt_min
        self.device = kv_caches[0][0].device

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> StepBatch:
        bs = self.block_size
        ids, pos, slots, lora = [], [], [], []
        rows, sample_seqs, prefills = [], [], []
        decode_tables, decode_lens = [], []
        scoring, done = _PromptRows(), []
        for seq, n in scheduled:
            start = len(ids)
            first = seq.num_computed
            ids.extend(seq.tokens[first : first + n])
            pos.extend(range(first, first + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(first, first + n))
            lora.extend([seq.lora_slot] * n)
            if n == 1:
                decode_tables.append(table)
                decode_lens.append(first + 1)
            else:
                prefills.append(PrefillChunk(start, n, first + n, self._tensor(table)))
            if seq.scored_until is not None:
                scoring.add(seq, start, first, n)
            if first + n < len(seq.tokens):
                continue
            if seq.params.max_tokens == 0:
                done.append(seq)
            else:
                rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decode=len(decode_tables),
            decode_block_tables=self._pad(decode_tables) if decode_tables else None,
            decode_context_lens=self._tensor(decode_lens) if decode_tables else None,
            prefills=prefills,
            dense_prompt_min=self.dense_prompt_min,
        )
        return StepBatch(
            input_ids=self._tensor(ids),
            positions=self._tensor(pos),
            lora_slots=self._tensor(lora),
            lora_count=len({s for s in lora if s >= 0}),
            meta=meta,
            sample_rows=self._tensor(rows),
            sample_seqs=sample_seqs,
            prompt_rows=self._tensor(scoring.rows) if scoring.rows else None,
            prompt_targets=self._tensor(scoring.targets) if scoring.rows else None,
            prompt_seqs=scoring.seqs,
            done=done,
        )

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _pad(self, tables: list[list[int]]) -> torch.Tensor:
        width = max(len(t) for t in tables)
        return self._tensor([t + [0] * (width - len(t)) for t in tables]).view(len(tables), width)

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepLogits:
        """-> the logits of the sample rows, and the prompt logprobs the step gathers."""
        logits = self._replay(batch)
        if logits is not None:
            return StepLogits(logits)
        hidden = self.forward(batch)
        logits = self.model.compute_logits(hidden.index_select(0, batch.sample_rows))
        return StepLogits(logits, self._score_prompts(batch, hidden))

    def _score_prompts(self, batch: StepBatch, hidden: torch.Tensor):
        if batch.prompt_rows is None:
            return []
        k = max(seq.params.prompt_logprobs for seq, _ in batch.prompt_seqs)
        lps, ranks, tops = score_rows(
            self.model.compute_logits,
            hidden.index_select(0, batch.prompt_rows),
            batch.prompt_targets,
            k,
        )
        out, at = [], 0
        for seq, count in batch.prompt_seqs:
            own = seq.params.prompt_logprobs
            top = [row[:own] for row in tops[at : at + count]] if own else []
            out.append((lps[at : at + count], ranks[at : at + count], top))
            at += count
        return out

    @torch.inference_mode()
    def follow(self, batch: StepBatch) -> None:
        """What a tensor-parallel worker runs of a step: the forward, then its vocab shard
        of each lm_head call `execute` makes on the driver, in the same order and sizes
        (the driver gathers the shards; only it samples and scores)."""
        hidden = self.forward(batch)
        self.model.compute_logits(hidden.index_select(0, batch.sample_rows))
        if batch.prompt_rows is not None:
            for rows in score_chunks(hidden.index_select(0, batch.prompt_rows)):
                self.model.compute_logits(rows)

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """The model over the step's tokens (KV written) -> hidden states [T, H]."""
        if self.mixed is not None:
            key = self.mixed.key_for(batch.input_ids.shape[0], batch.lora_count)
            hidden = self.mixed.run(key, batch) if key is not None else None
            if hidden is not None:
                return hidden
        if self.lora_ctx is not None:
            self.lora_ctx.set(batch.lora_slots, batch.any_lora, batch.lora_count or None)
        return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)

    def _replay(self, batch: StepBatch) -> torch.Tensor | None:
        """Logits from a CUDA-graph replay when the step is decode-only, else None."""
        meta = batch.meta
        n = meta.num_decode
        if self.graphs is None or meta.prefills or not n or batch.sample_rows.shape[0] != n:
            return None
        if batch.prompt_rows is not None:
            return None
        key = self.graphs.key_for(n, meta.decode_block_tables.shape[1], batch.lora_count)
        return self.graphs.run(key, batch) if key is not None else None


class _PromptRows:
    """The prompt rows of one step being prepared (`StepBatch.prompt_rows`)."""

    def __init__(self):
        self.rows: list[int] = []
        self.targets: list[int] = []
        self.seqs: list[tuple[Sequence, int]] = []

    def add(self, seq: Sequence, start: int, first: int, n: int) -> None:
        """seq's chunk of positions [first, first + n) sits at rows start.. of the step."""
        positions = positions_to_score(first, n, seq.prompt_len, len(seq.prompt_logprobs))
        if not positions:
            return
        self.rows.extend(start + p - first for p in positions)
        self.targets.extend(seq.tokens[p + 1] for p in positions)
        self.seqs.append((seq, len(positions)))
