"""Per-request changes of the logits that decide which token is picked: logit_bias and the
repetition / presence / frequency penalties (OpenAI and vLLM semantics).

Semantics per row, in this order (vLLM's), on the raw logits, before greedy argmax and
before temperature / top-k / top-p; count_j is how many times token j appears among the
tokens generated so far, seen_j whether j is in the prompt or among them:

    logit[j] += bias_j                                          (logit_bias)
    if seen_j: logit[j] = logit[j] / r if logit[j] > 0 else logit[j] * r   (repetition r)
    logit[j] -= presence * (count_j > 0) + frequency * count_j  (OpenAI's penalties)

Cost: when no row uses any of them, nothing (the logits come back as they are: no launch,
no host sync, no allocation). Otherwise only the rows that use one are touched: they are
gathered, biased by one index_put, counted by one scatter_add over a padded tensor of
their tokens, penalised by a few elementwise ops, and copied back into a copy of the
logits (the caller's stay raw, for logprobs). The host builds the token tensor with numpy
per row, not per token (each prompt converted once per request); nothing is read back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from replica.sampling_params import SamplingParams


class TokenHistory(Protocol):
    """What the penalties read of a request (`replica.sequence.Sequence` is one)."""

    tokens: list[int]
    """The prompt followed by the tokens generated so far."""
    prompt_len: int

    @property
    def prompt_array(self) -> np.ndarray:
        """int64 [prompt_len]: the prompt's ids, built once per request (the repetition
        penalty reads them every step; converting a long prompt's list each step cost
        the host ~1 ms per step at 64 rows of 1k-token prompts)."""
        ...


def process_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    history: Sequence[TokenHistory] | None,
) -> torch.Tensor:
    """logits: float32 [n, V] -> float32 [n, V]: `logits` itself when no row processes its
    logits, else a copy whose processed rows follow the module's semantics (the other rows
    are bit-identical). history: each row's tokens (needed when a row is penalised).

    Example: logits [[1., -1., 2.]], repetition 2 and tokens [0, 1] -> [[.5, -2., 2.]].
    """
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    used = [params[i] for i in rows]
    at = torch.tensor(rows, device=logits.device)
    sub = logits[at]  # [m, V], a copy
    if any(p.logit_bias for p in used):
        _add_bias(sub, used)
    if any(p.penalised for p in used):
        assert history is not None, "penalised rows need their token history"
        sub = _penalise(sub, used, [history[i] for i in rows])
    return logits.index_copy(0, at, sub)


def _add_bias(sub: torch.Tensor, used: list[SamplingParams]) -> None:
    """sub: float32 [m, V], updated in place: sub[i, id] += bias for each row's pairs."""
    row_ids = [i for i, p in enumerate(used) for _ in p.logit_bias]
    token_ids = [t for p in used for t, _ in p.logit_bias]
    biases = [b for p in used for _, b in p.logit_bias]
    where = torch.tensor([row_ids, token_ids], device=sub.device)
    values = torch.tensor(biases, dtype=sub.dtype, device=sub.device)
    sub.index_put_((where[0], where[1]), values, accumulate=True)


def _penalise(
    sub: torch.Tensor, used: list[SamplingParams], history: list[TokenHistory]
) -> torch.Tensor:
    """sub: float32 [m, V] -> float32 [m, V] with repetition, then presence and frequency.
    Rows without penalties (bias only) have r = 1 and no tokens: they come out unchanged."""
    m, vocab = sub.shape
    with_prompt = any(p.repetition_penalty != 1.0 for p in used)
    tokens = torch.from_numpy(_token_table(used, history, vocab, with_prompt)).to(sub.device)
    # Columns: [0, V) output counts, V padding, then (with_prompt) [V+1, 2V+1) prompt
    # counts and 2V+1 unused: one scatter_add counts both.
    counts = torch.zeros(m, (vocab + 1) * (2 if with_prompt else 1), device=sub.device)
    counts.scatter_add_(1, tokens, torch.ones(tokens.shape, device=sub.device))
    out_counts = counts[:, :vocab].to(sub.dtype)
    factors = torch.tensor(
        [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in used],
        dtype=sub.dtype,
        device=sub.device,
    )
    if with_prompt:
        seen = (counts[:, :vocab] + counts[:, vocab + 1 : 2 * vocab + 1]) > 0
        rep = factors[:, 0:1]
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    return sub - (factors[:, 1:2] * out_counts + factors[:, 2:3] * (out_counts > 0))


def _token_table(
    used: list[SamplingParams], history: list[TokenHistory], vocab: int, with_prompt: bool
) -> np.ndarray:
    """-> int64 [m, L]: row i's generated token ids, then (when its repetition penalty is
    on) its prompt ids shifted by V + 1, padded with V (a column nobody reads).
    Example (V = 10, r on, prompt [3], output [4, 4]; a second row without r, output [5]):
    [[4, 4, 14], [5, 10, 10]]."""
    rows = []
    for p, h in zip(used, history, strict=True):
        if not p.penalised:
            rows.append(np.empty(0, np.int64))
            continue
        out = np.asarray(h.tokens[h.prompt_len :], dtype=np.int64)
        if with_prompt and p.repetition_penalty != 1.0:
            prompt = h.prompt_array + (vocab + 1)
            out = np.concatenate([out, prompt])
        rows.append(out)
    table = np.full((len(rows), max(1, max(len(r) for r in rows))), vocab, dtype=np.int64)
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
    return table
