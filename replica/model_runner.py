"""Builds one step's flattened batch, runs the model, returns logits of sampling rows.

Layout of a step with decode sequences d0, d1 and a prefill chunk p (3 tokens):
    tokens:     [d0, d1, p0, p1, p2]
    positions:  [n_d0 - 1, n_d1 - 1, c, c + 1, c + 2]   (c = p's cached tokens)
    lora slots: [slot(d0), slot(d1), slot(p) x 3]     (-1 for base-model requests)
    sample rows: 0, 1 and 4 if p's chunk ends its known tokens, else 0, 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replica.layers.attention import AttentionMetadata, PrefillChunk
from replica.models.llama import CausalLM
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

    @property
    def any_lora(self) -> bool:
        return self.lora_count > 0


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        lora_ctx=None,
        graphs=None,
    ):
        """graphs: a `replica.cuda_graphs.DecodeGraphs` to replay decode-only steps, or None."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.lora_ctx = lora_ctx
        self.graphs = graphs
        self.device = kv_caches[0][0].device

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> StepBatch:
        bs = self.block_size
        ids, pos, slots, lora = [], [], [], []
        rows, sample_seqs, prefills = [], [], []
        decode_tables, decode_lens = [], []
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
            if first + n == len(seq.tokens):
                rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decode=len(decode_tables),
            decode_block_tables=self._pad(decode_tables) if decode_tables else None,
            decode_context_lens=self._tensor(decode_lens) if decode_tables else None,
            prefills=prefills,
        )
        return StepBatch(
            input_ids=self._tensor(ids),
            positions=self._tensor(pos),
            lora_slots=self._tensor(lora),
            lora_count=len({s for s in lora if s >= 0}),
            meta=meta,
            sample_rows=self._tensor(rows),
            sample_seqs=sample_seqs,
        )

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _pad(self, tables: list[list[int]]) -> torch.Tensor:
        width = max(len(t) for t in tables)
        return self._tensor([t + [0] * (width - len(t)) for t in tables]).view(len(tables), width)

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """-> float32 logits [len(sample_seqs), V]."""
        logits = self._replay(batch)
        if logits is not None:
            return logits
        hidden = self.forward(batch)
        return self.model.compute_logits(hidden.index_select(0, batch.sample_rows))

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """The model over the step's tokens (KV written) -> hidden states [T, H]; what a
        tensor-parallel worker runs (only the driver computes logits)."""
        if self.lora_ctx is not None:
            self.lora_ctx.set(batch.lora_slots, batch.any_lora, batch.lora_count or None)
        return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)

    def _replay(self, batch: StepBatch) -> torch.Tensor | None:
        """Logits from a CUDA-graph replay when the step is decode-only, else None."""
        meta = batch.meta
        n = meta.num_decode
        if self.graphs is None or meta.prefills or not n or batch.sample_rows.shape[0] != n:
            return None
        key = self.graphs.key_for(n, meta.decode_block_tables.shape[1], batch.lora_count)
        return self.graphs.run(key, batch) if key is not None else None
