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


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> Sampled:
    """logits: float32 [n, V] -> the sampled token of each row, with logprobs if asked.

    Semantics per non-greedy row: keep the top_k most likely tokens of softmax(logits / t)
    (0 = all), then the smallest most-likely-first prefix of what is left whose mass
    reaches top_p, and draw one token from the kept ones in proportion to their
    probability, by the row's own uniform draw. All rows are drawn in one batch of
    tensor ops with one host sync per step, whatever the batch size.
    """
    picked = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        at = torch.tensor(rows, device=logits.device)
        drawn = _draw(logits[at], [params[i] for i in rows], [generators[i] for i in rows])
        picked = picked.index_copy(0, at, drawn)
    tokens = picked.tolist()
    if not any(p.logprobs for p in params):
        return Sampled(tokens, None, None)
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, picked[:, None])[:, 0]
    return Sampled(tokens, chosen.tolist(), _top_logprobs(logp, params))


def _draw(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """logits: float32 [m, V] -> int64 [m]: one token per row by inverse-CDF sampling of
    its kept distribution (see `sample`), with one uniform from the row's generator."""
    m, vocab = logits.shape
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], device=dev)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    order = None
    if all(p.top_k for p in params):  # only the most likely max(top_k) can be kept
        probs, order = probs.topk(min(vocab, max(p.top_k for p in params)), dim=-1)
        probs = probs * _kept(probs, params)
    elif any(p.top_k or p.top_p < 1.0 for p in params):
        probs, order = probs.sort(dim=-1, descending=True)
        probs = probs * _kept(probs, params)
    cdf = probs.cumsum(dim=-1)
    target = _uniforms(generators, dev)[:, None] * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1)
    return (idx if order is None else order.gather(1, idx))[:, 0]


def _kept(sorted_probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """sorted_probs: float32 [m, V'] (each row's V' most likely, descending) -> float32
    [m, V'] 1/0 mask of the tokens top_k and then top_p keep (top_p over the top-k
    renormalised mass)."""
    m, vocab = sorted_probs.shape
    dev = sorted_probs.device
    ks = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=dev)
    top_ps = torch.tensor([p.top_p for p in params], device=dev)
    keep = torch.arange(vocab, device=dev)[None, :] < ks[:, None]
    kept = sorted_probs * keep
    kept = kept / kept.sum(dim=-1, keepdim=True)
    # the smallest prefix whose mass reaches top_p (always the first token)
    keep &= kept.cumsum(dim=-1) - kept < top_ps[:, None]
    return keep.to(sorted_probs.dtype)


def _uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """float32 [m] in [0, 1): one draw from each row's generator (the default one for
    rows without), so a seeded row's tokens do not depend on what shares its batch."""
    shared = torch.rand(len(generators), device=device)
    if all(g is None for g in generators):
        return shared
    parts = [
        shared[j : j + 1] if g is None else torch.rand(1, generator=g, device=g.device).to(device)
        for j, g in enumerate(generators)
    ]
    return torch.cat(parts)


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
