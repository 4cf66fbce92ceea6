"""Token sampling: logit_bias, penalties and allowed_token_ids, greedy, temperature,
min-p, top-k, top-p, per-request seeded streams.

A seeded request draws from its own SeedStream (a counter-based hash of its seed), so it
gives the same tokens whatever else shares its batch.
Logprobs are of the sampled token under the model's raw distribution (log_softmax of the
logits before logit_bias, penalties, allowed_token_ids, temperature, min-p, top-k and
top-p: vLLM's default
"raw_logprobs"); top logprobs are the most likely tokens of that same distribution.
Neither is computed unless some row asks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from replica.logits_processors import TokenHistory, process_logits
from replica.outputs import TopLogprobs
from replica.sampling_params import SamplingParams


class Sampled(NamedTuple):
    """One step's samples, row by row.

    tokens: the sampled token of each row.
    logprobs: each row's sampled-token logprob; None when no row asked for logprobs.
    top: each row's `top_logprobs` most likely (token, logprob), most likely first;
        None when no row asked for alternatives.
    non_finite: rows whose logits hold a NaN or +inf, or no finite value (their token,
        a valid id, logprobs and alternatives are meaningless; the engine fails them).
    """

    tokens: list[int]
    logprobs: list[float] | None
    top: list[TopLogprobs] | None
    non_finite: list[int]


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    streams: list[SeedStream | None],
    generator: torch.Generator | None = None,
    history: Sequence[TokenHistory] | None = None,
    banned: Sequence[tuple[int, ...]] | None = None,
) -> Sampled:
    """logits: float32 [n, V] -> the sampled token of each row, with logprobs if asked.
    Rows without a stream draw from generator (torch's default one when None). history:
    each row's prompt and generated tokens (read only for penalised rows). banned: token
    ids each row may not sample this step (min_tokens' stop tokens; None: none).

    Semantics per row: first logit_bias, the penalties and allowed_token_ids
    (`process_logits`); a greedy row then takes the argmax, a non-greedy row takes
    softmax(logits / t), drops the tokens less likely than min_p x its most likely one
    (0 = none; vLLM v1's order: after temperature, before top-k / top-p; HF applies it
    after them), keeps the top_k most likely of the rest (0 = all), then the smallest
    most-likely-first prefix of what is left whose renormalised mass reaches top_p, and
    draws one token from the kept ones in proportion to their probability, by the row's
    own uniform draws. Rows are drawn in batches of tensor
    ops: rows with top_k over their top-k (one `topk`), rows with only top_p by rejection
    against the nucleus (no sort of the vocabulary; a host sync per rejection round),
    the rest straight from their distribution. Rows with a NaN or +inf logit, or none
    finite, are drawn from zeros instead (so they cannot stall the rejection rounds) and
    reported in `non_finite`; -inf logits beside finite ones only mask their tokens.
    """
    raw, logits = logits, process_logits(logits, params, history, banned)
    picked = logits.argmax(dim=-1)
    # argmax propagates NaN, so the picked logit is NaN, +inf or (no finite logit) -inf
    # exactly when the row is bad; -inf beside finite logits is a legitimate mask
    finite = torch.isfinite(logits.gather(1, picked[:, None])[:, 0])
    rows = [i for i, p in enumerate(params) if not p.greedy]
    for group, draw in (
        ([i for i in rows if params[i].top_k], _draw_top_k),
        ([i for i in rows if not params[i].top_k and params[i].top_p < 1.0], _draw_nucleus),
        ([i for i in rows if not params[i].top_k and params[i].top_p >= 1.0], _draw_plain),
    ):
        if group:
            at = torch.tensor(group, device=logits.device)
            sub = logits[at].masked_fill_(~finite[at, None], 0.0)  # a copy: logits stay as they are
            drawn = draw(sub, [params[i] for i in group], [streams[i] for i in group], generator)
            picked = picked.index_copy(0, at, drawn)
    # bad rows travel as -1 - token, so one transfer carries both (one host sync; the
    # nucleus rounds have theirs)
    coded = torch.where(finite, picked, -1 - picked).tolist()
    non_finite = [i for i, t in enumerate(coded) if t < 0]
    tokens = [t if t >= 0 else -1 - t for t in coded]
    if not any(p.logprobs for p in params):
        return Sampled(tokens, None, None, non_finite)
    logp = torch.log_softmax(raw, dim=-1)
    chosen = logp.gather(1, picked[:, None])[:, 0]
    return Sampled(tokens, chosen.tolist(), _top_logprobs(logp, params), non_finite)


def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """float32 [m, V] (finite rows) -> softmax(logits / t) per row, min-p applied
    (`_min_p`) when a row has it.

    The row max is subtracted before dividing: for a tiny t (1e-38 is a valid temperature)
    logits / t overflow to +-inf and softmax turns them into NaN, which drew arbitrary
    tokens; (logits - max) / t is <= 0, so such a row becomes one-hot on its argmax. A t
    below float32's range (1e-46) would round to 0 (0 / 0 = NaN): it is raised to the
    smallest normal float32, which draws the same one-hot row.
    """
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    temps = temps.clamp_(min=torch.finfo(temps.dtype).tiny)
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(shifted / temps[:, None], dim=-1)
    return _min_p(probs, params) if any(p.min_p for p in params) else probs


def _min_p(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """probs: float32 [m, V] -> the same with, in each row with min_p > 0, the tokens less
    likely than min_p x the row's most likely one set to 0 and the rest renormalised
    (vLLM's and HF's MinPLogitsWarper rule; the most likely token always stays). Rows
    without min_p come back bit-identical (threshold 0, divided by 1), so a seeded row
    draws the same whatever shares its batch.

    Example: probs [[.5, .3, .15, .05]], min_p 0.5 -> [[.625, .375, 0, 0]].
    """
    min_p = torch.tensor([p.min_p for p in params], device=probs.device)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    kept = torch.where(probs >= threshold, probs, 0.0)
    mass = torch.where(min_p > 0, kept.sum(dim=-1), 1.0)
    return kept / mass[:, None]


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights: float32 [m, V] >= 0 (each row some > 0), u: [m] in [0, 1) -> int64 [m, 1]:
    the index where u of the row's total mass falls."""
    cdf = weights.cumsum(dim=-1)
    idx = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)
    return idx.clamp_(max=weights.shape[1] - 1)


def _draw_top_k(
    logits: torch.Tensor,
    params: list[SamplingParams],
    streams: list[SeedStream | None],
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Rows with top_k > 0 -> int64 [m]: only each row's max(top_k) likeliest can be kept."""
    probs = _probs(logits, params)
    probs, order = probs.topk(min(probs.shape[1], max(p.top_k for p in params)), dim=-1)
    idx = _inverse_cdf(probs * _kept(probs, params), _uniforms(streams, logits.device, generator))
    return order.gather(1, idx)[:, 0]


def _draw_plain(
    logits: torch.Tensor,
    params: list[SamplingParams],
    streams: list[SeedStream | None],
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Rows with neither top_k nor top_p -> int64 [m]."""
    probs = _probs(logits, params)
    return _inverse_cdf(probs, _uniforms(streams, logits.device, generator))[:, 0]


# Rejection rounds at most; each round's rejects move their pivot above the token they
# drew, so the candidates shrink towards the nucleus (a few rounds in practice).
MAX_NUCLEUS_ROUNDS = 64


def _draw_nucleus(
    logits: torch.Tensor,
    params: list[SamplingParams],
    streams: list[SeedStream | None],
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Rows without top_k -> int64 [m], top-p by rejection: draw from the tokens more
    likely than the row's pivot (at first all), accept a token when the mass of tokens
    more likely than it is below top_p (it is in the nucleus), else raise the pivot to
    its probability (no less likely token is in the nucleus either) and draw again.
    An accepted draw follows the probabilities restricted to the nucleus, as `sample`
    says, and each round draws only for the rows still drawing (batch-invariant)."""
    probs = _probs(logits, params)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device)
    tokens = torch.zeros(len(params), dtype=torch.long, device=logits.device)
    pivot = torch.full((len(params),), -1.0, device=logits.device)
    todo = list(range(len(params)))
    for round_ in range(MAX_NUCLEUS_ROUNDS):
        at = torch.tensor(todo, device=logits.device)
        rows = probs if len(todo) == len(params) else probs[at]
        # in the first round every pivot is -1: all tokens are candidates
        weights = rows if round_ == 0 else torch.where(rows > pivot[at, None], rows, 0.0)
        idx = _inverse_cdf(weights, _uniforms([streams[j] for j in todo], logits.device, generator))
        p_tok = rows.gather(1, idx)[:, 0]
        above = torch.where(rows > p_tok[:, None], rows, 0.0).sum(dim=-1)
        accept = above < top_p[at]
        tokens[at], pivot[at] = idx[:, 0], p_tok
        todo = [j for j, ok in zip(todo, accept.tolist(), strict=True) if not ok]
        if not todo:
            break
    return tokens


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


class SeedStream:
    """A seeded request's uniform draws: draw i is a hash of (seed, i), so a row's tokens
    do not depend on what shares its batch, and the same on CPU and CUDA.

    The hash is Wellons' lowbias32 (a bijection of 32-bit words with near-ideal avalanche)
    on numpy uint32, whose multiplication wraps by definition: key = mix(mix(seed_hi ^ c)
    ^ seed_lo) once per request; draw i = mix(key ^ mix(i ^ c')) >> 8 as a 24-bit float in
    [0, 1). A step's draws for all seeded rows are a few numpy ops on the host and one copy
    to the device, however many rows are seeded (a torch.Generator per row took one
    launch per row per draw).
    """

    __slots__ = ("key", "drawn")

    def __init__(self, seed: int):
        s = seed & 0xFFFF_FFFF_FFFF_FFFF  # signed 64-bit seeds map onto their bit pattern
        hi, lo = np.array([s >> 32], dtype=np.uint32), np.array([s & 0xFFFF_FFFF], np.uint32)
        self.key = int(_mix32(_mix32(hi ^ np.uint32(0x9E37_79B9)) ^ lo)[0])
        self.drawn = 0


def _mix32(x: np.ndarray) -> np.ndarray:
    """lowbias32 over uint32 [m] (wrapping multiplies)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB_352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846C_A68B)
    return x ^ (x >> np.uint32(16))


def seeded_uniforms(streams: list[SeedStream]) -> np.ndarray:
    """float32 [m] in [0, 1): the next draw of each stream (each stream advances by one)."""
    keys = np.fromiter((st.key for st in streams), dtype=np.uint32, count=len(streams))
    drawn = np.fromiter((st.drawn for st in streams), dtype=np.uint32, count=len(streams))
    for st in streams:
        st.drawn += 1
    h = _mix32(keys ^ _mix32(drawn ^ np.uint32(0x85EB_CA6B)))
    return (h >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)


def _uniforms(
    streams: list[SeedStream | None], device: torch.device, generator: torch.Generator | None
) -> torch.Tensor:
    """float32 [m] in [0, 1): one draw per row, from its seed's stream when it has one (a
    seeded row's tokens do not depend on what shares its batch), else generator's."""
    shared = torch.rand(len(streams), device=device, generator=generator)
    seeded = [j for j, st in enumerate(streams) if st is not None]
    if not seeded:
        return shared
    drawn = torch.from_numpy(seeded_uniforms([streams[j] for j in seeded])).to(device)
    return shared.index_copy(0, torch.tensor(seeded, device=device), drawn)


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
