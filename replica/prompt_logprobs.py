"""Prompt logprobs: the raw-distribution logprob of each prompt token after the first.

Prompt token j's logprob comes from the logits at position j - 1, so a step that computes
positions [a, b) of a prompt of P tokens scores prompt tokens a + 1 .. min(b, P - 1)
(those not scored by an earlier pass: a preempted sequence recomputes its chunks).
Example, prompt [7, 8, 9] in chunks of 2: step 1 runs positions 0-1 and scores tokens 8
(from position 0) and 9 (position 1); step 2 runs position 2 and scores nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from replica.outputs import TopLogprobs

SCORE_ROWS = 256
"""Rows per lm_head call: bounds the float32 [rows, V] logits a long prompt chunk builds
at once (256 x 128256 x 4 B = 131 MB)."""


def positions_to_score(first: int, n: int, prompt_len: int, scored: int) -> range:
    """Positions of a chunk [first, first + n) whose logits score a prompt token not yet
    scored (positions before `scored` were; the last prompt position scores nothing)."""
    return range(max(first, scored), min(first + n, prompt_len - 1))


def score_chunks(hidden: torch.Tensor) -> list[torch.Tensor]:
    """hidden: [m, H] -> its rows in lm_head calls of at most SCORE_ROWS: the calls
    score_rows makes, which a tensor-parallel worker makes too (each gathers logits)."""
    return [hidden[start : start + SCORE_ROWS] for start in range(0, hidden.shape[0], SCORE_ROWS)]


def score_rows(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    k: int,
) -> tuple[list[float], list[int], list[TopLogprobs]]:
    """hidden: [m, H] at the scored positions; targets: long [m], the prompt token after
    each -> (logprob of each target, its rank, its row's k most likely (token, logprob),
    most likely first; [] when k is 0), under log_softmax of the raw logits.

    A target's rank is 1 + the number of other tokens at least as likely (vLLM's: a token
    tied with the target counts before it). Example: logprobs [-1, -2, -2] -> token 1 and
    token 2 both rank 3, token 0 ranks 1."""
    lps: list[float] = []
    ranks: list[int] = []
    tops: list[TopLogprobs] = []
    start = 0
    for rows in score_chunks(hidden):
        logp = torch.log_softmax(compute_logits(rows), dim=-1)
        own = logp.gather(1, targets[start : start + rows.shape[0], None])
        lps += own[:, 0].tolist()
        ranks += (logp >= own).sum(dim=-1).tolist()
        start += rows.shape[0]
        if k:
            values, ids = logp.topk(k, dim=-1)
            tops += [
                tuple(zip(row_ids, row_values, strict=True))
                for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)
            ]
    return lps, ranks, tops
