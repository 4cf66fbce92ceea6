"""The embedding and the lm_head split by vocabulary across a tensor-parallel group
(Megatron / vLLM vocab-parallel).

The vocabulary V is padded up to Vp, the next multiple of tp, and rank r holds rows
[r * Vp/tp, (r+1) * Vp/tp) of the table: the padding rows (past V, on the last ranks)
stay zero, no id looks them up and their logits are dropped.
- Embedding: each rank looks up the ids it holds, gives 0 rows for the others, and the
  group all-reduces (sums) the [T, H] result, so every rank ends with every token's row
  (a row plus zeros: exactly the row).
- LM head: each rank computes the logits of its vocab shard, [n, Vp/tp]; the shards are
  gathered to rank 0 alone (the rank that samples), which drops the padding columns.
Tied embeddings share one shard: the lm_head's weight is the embedding's.

Example (V 5, tp 2, so Vp 6): rank 0 holds ids 0-2, rank 1 ids 3-4 and one padding row.
Ids [4, 1]: rank 0 looks up [0, e1], rank 1 [e4, 0]; the sum is [e4, e1] on both. One
row's logits: rank 0 [l0 l1 l2], rank 1 [l3 l4 pad]; rank 0 returns [l0 l1 l2 l3 l4].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replica.layers.linear import Sliceable, shape_of
from replica.parallel import SINGLE, TPGroup


class VocabParallelEmbedding(nn.Module):
    """One rank's rows of a [V, H] embedding table. weight: [Vp/tp, H]."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.hidden = hidden
        self.shard_size = -(-vocab_size // tp.size)
        """Rows per rank: Vp / tp, where Vp is V padded up to a multiple of tp."""
        self.start = tp.rank * self.shard_size
        """The first vocabulary id this rank holds."""
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden), requires_grad=False)

    def real_rows(self, rank: int) -> int:
        """Rows of rank `rank`'s shard that hold vocabulary ids (the rest are padding)."""
        return max(0, min(self.shard_size, self.vocab_size - rank * self.shard_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: long [T], each in [0, V) -> [T, H]: every token's row, on every rank."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.shard_size)
        x = F.embedding(local.masked_fill(~mine, 0), self.weight)
        x.masked_fill_(~mine[:, None], 0.0)
        return self.tp.all_reduce(x)

    def weight_loader(self, param: nn.Parameter, loaded: Sliceable) -> None:
        """Copy this rank's rows of the checkpoint's whole [V, H] table (a tensor or a
        safetensors slice, of which only those rows are read) into param."""
        shape = shape_of(loaded)
        if shape != (self.vocab_size, self.hidden):
            raise ValueError(f"shape {shape} does not fit {(self.vocab_size, self.hidden)}")
        n = self.real_rows(self.tp.rank)
        if n:
            param.data[:n].copy_(loaded[self.start : self.start + n])


class ParallelLMHead(VocabParallelEmbedding):
    """One rank's vocab shard of the lm_head: weight [Vp/tp, H] (no bias)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [n, H] -> float32 logits [n, V] on rank 0; None on the other ranks.

        Every rank must make the same calls with the same n (the gather is collective);
        n 0 communicates nothing."""
        logits = F.linear(hidden, self.weight)
        if self.tp.size == 1:
            return logits.float()
        n = hidden.shape[0]
        parts = self.tp.gather(logits) if n else [logits] * self.tp.size
        if self.tp.rank != 0:
            return None
        out = torch.empty(n, self.vocab_size, dtype=torch.float32, device=hidden.device)
        for r, part in enumerate(parts):
            lo, width = r * self.shard_size, self.real_rows(r)
            out[:, lo : lo + width] = part[:, :width]
        return out
