"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators.

Each request draws from its own torch.Generator, exactly one draw per step, so a
seeded request gives the same tokens whatever else shares its batch.
Logprobs are of the sampled token under the model's raw distribution (log_softmax
of the logits before temperature / top-k / top-p); top logprobs are the most likely
tokens of that same distribution. Neither is computed unless some row asks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from replica.outputs import TopLogprobs
from replica.sampling_params import SamplingParams


class Sampled(NamedTuple):
    """One step's samples, row by row.

    tokens: the sampled token of each row.
    logprobs: each row's sampled-token logprob; None when no row asked for logprobs.
    top: each row's `top_logprobs` most likely (token, logprob), most likely first;
        None when no row asked for alternatives.
    """

    tokens: list[int]
    logprobs: list[float] | None
    top: list[TopLogprobs] | None


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: float32 [V] (already temperature-scaled) -> logits with dropped tokens at -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always the first token).
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> Sampled:
    """logits: float32 [n, V] -> the sampled token of each row, with logprobs if asked."""
    greedy = logits.argmax(dim=-1)
    tokens = greedy.tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = _filter_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        gen = generators[i]
        if gen is not None and gen.device != probs.device:
            probs = probs.to(gen.device)
        tokens[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    if not any(p.logprobs for p in params):
        return Sampled(tokens, None, None)
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
    return Sampled(tokens, picked.tolist(), _top_logprobs(logp, params))


def _top_logprobs(logp: torch.Tensor, params: list[SamplingParams]) -> list[TopLogprobs] | None:
    """logp: float32 [n, V] log_softmax -> each row's top_logprobs best (token, logprob)."""
    k = max(p.top_logprobs for p in params)
    if not k:
        return None
    values, ids = logp.topk(k, dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [
        tuple(zip(ids[i][: p.top_logprobs], values[i][: p.top_logprobs], strict=True))
        for i, p in enumerate(params)
    ]
