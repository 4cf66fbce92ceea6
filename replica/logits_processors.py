"""Per-request changes of the logits that decide which token is picked: logit_bias, the
repetition / presence / frequency penalties (OpenAI and vLLM semantics), the tokens a
row may not sample this step (min_tokens' stop tokens: a bias of -inf) and the only
tokens it may sample (allowed_token_ids).

Semantics per row, in this order (vLLM's), on the raw logits, before greedy argmax and
before temperature / min-p / top-k / top-p; count_j is how many times token j appears
among the tokens generated so far, seen_j whether j is in the prompt or among them:

    logit[j] += bias_j                                          (logit_bias)
    if seen_j: logit[j] = logit[j] / r if logit[j] > 0 else logit[j] * r   (repetition r)
    logit[j] -= presence * (count_j > 0) + frequency * count_j  (OpenAI's penalties)
    if j not in allowed: logit[j] = -inf                        (allowed_token_ids)

vLLM masks allowed_token_ids first; -inf stays -inf under every step above, so masking
last gives the same logits.

Cost: when no row uses any of them, nothing (the logits come back as they are: no launch,
no host sync, no allocation). Otherwise one copy of the logits (the caller's stay raw, for
logprobs), one transfer, about 25 launches, and work in proportion to the tokens involved,
not to the vocabulary. The host builds one int64 array (`_Plan`: flat indices row * V +
token of the entries to penalise and of the biased pairs, then the rows' factors and the
biases as float32), with numpy per row, not per token (each prompt converted once per
request), and sends it from pinned memory. The biases go in by one scatter_add; the
penalties change only the entries of tokens a penalised row has seen, which are gathered,
penalised and written back by one scatter, each entry's output count coming from a sorted
copy of the output entries (two searchsorted). A row with allowed_token_ids has its
allowed entries gathered, its whole row filled with -inf and the entries scattered back
(one gather, one fill, one scatter for all such rows; its ids cross as flat indices).
Nothing else of size rows x vocabulary is built, nothing is read back.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from replica.sampling_params import SamplingParams


class TokenHistory(Protocol):
    """What the penalties read of a request (`replica.sequence.Sequence` is one)."""

    @property
    def prompt_array(self) -> np.ndarray:
        """int64 [prompt_len]: the prompt's ids, built once per request (the repetition
        penalty reads them every step; converting a long prompt's list each step cost
        the host ~1 ms per step at 64 rows of 1k-token prompts)."""
        ...

    @property
    def output_array(self) -> np.ndarray:
        """int64 [generated]: the ids generated so far, kept up to date as tokens come
        (not converted from a list each step)."""
        ...


def process_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    history: Sequence[TokenHistory] | None,
    banned: Sequence[tuple[int, ...]] | None = None,
) -> torch.Tensor:
    """logits: float32 [n, V] -> float32 [n, V]: `logits` itself when no row processes its
    logits, else a copy whose processed rows follow the module's semantics (the other rows
    are bit-identical). history: each row's tokens (needed when a row is penalised).
    banned: each row's tokens whose logit becomes -inf (after logit_bias; None: none).

    Example: logits [[1., -1., 2.]], repetition 2 and tokens [0, 1] -> [[.5, -2., 2.]];
    allowed_token_ids (0, 1) -> [[1., -1., -inf]].
    """
    banned = banned or [()] * len(params)
    rows = [i for i, p in enumerate(params) if p.processes_logits or banned[i]]
    if not rows:
        return logits
    penalised = [i for i in rows if params[i].penalised]
    if penalised:
        assert history is not None, "penalised rows need their token history"
    n, vocab = logits.shape
    plan = _Plan.build(rows, penalised, params, history or (), n, vocab, banned)
    at = _STAGING.to_device(plan.words, logits.device)
    out = logits.clone(memory_format=torch.contiguous_format)  # viewed flat below
    flat = out.view(-1)
    floats = at[plan.floats_at :].view(torch.float32)
    if plan.num_bias:
        where = at[plan.num_seen : plan.allowed_at]
        flat.scatter_add_(0, where, floats[3 * n : 3 * n + plan.num_bias])
    if plan.num_seen:
        _penalise(flat, at[: plan.num_seen], plan.num_out, floats[: 3 * n].view(n, 3), vocab)
    if plan.num_allowed:
        where = at[plan.allowed_at : plan.masked_at]
        kept = flat.gather(0, where)
        out.index_fill_(0, at[plan.masked_at : plan.floats_at], float("-inf"))
        flat.scatter_(0, where, kept)
    return out


def _penalise(
    flat: torch.Tensor, seen: torch.Tensor, num_out: int, factors: torch.Tensor, vocab: int
) -> None:
    """flat: float32 [n * V] (the biased logits), updated in place: repetition, then
    presence and frequency, on the entries `seen` (int64 [N] flat indices, the first
    num_out the output tokens'); factors: float32 [n, 3] (repetition, frequency, presence)
    per row. No other entry changes: for them the penalties are the identity."""
    per_entry = factors.index_select(0, seen // vocab)  # [N, 3]
    vals = flat.gather(0, seen)
    rep = per_entry[:, 0]
    vals = torch.where(vals > 0, vals / rep, vals * rep)
    # how often each entry's (row, token) occurs among the output entries
    generated = torch.sort(seen[:num_out]).values
    count = torch.searchsorted(generated, seen, right=True) - torch.searchsorted(generated, seen)
    count = count.to(flat.dtype)
    vals = vals - (per_entry[:, 1] * count + per_entry[:, 2] * (count > 0))
    # a (row, token) seen twice is two entries with the same value: either write wins
    flat.scatter_(0, seen, vals)


@dataclass
class _Plan:
    """What the device needs for one call, in one int64 array (so one transfer):

        [0, num_seen)             flat indices row * V + token of the entries to penalise:
                                  every penalised row's generated tokens first (num_out of
                                  them), then the prompts of rows whose repetition is on
        [num_seen, allowed_at)    flat indices of the logit_bias pairs, then of the
                                  banned tokens (bias -inf)
        [allowed_at, masked_at)   flat indices of the allowed_token_ids of the rows
                                  that have them (num_allowed)
        [masked_at, floats_at)    those rows
        [floats_at, ...)          float32, two per word: factors [n, 3] (repetition,
                                  frequency, presence; rows without penalties 1, 0, 0),
                                  then the bias values

    Example (V = 10, n = 2; row 0 with repetition 2 on, prompt [3], output [4, 4]; row 1
    without it, output [5], bias {7: 1.5}, allowed (2, 7)): seen [4, 4, 15, 3], num_out 3,
    bias at [17], allowed at [12, 17], masked rows [1].
    """

    words: np.ndarray
    num_seen: int
    num_out: int
    floats_at: int
    num_bias: int
    allowed_at: int
    masked_at: int

    @property
    def num_allowed(self) -> int:
        return self.masked_at - self.allowed_at

    @classmethod
    def build(
        cls,
        rows: list[int],
        penalised: list[int],
        params: list[SamplingParams],
        history: Sequence[TokenHistory],
        n: int,
        vocab: int,
        banned: Sequence[tuple[int, ...]],
    ) -> _Plan:
        repeated = [i for i in penalised if params[i].repetition_penalty != 1.0]
        seen = [history[i].output_array for i in penalised]
        seen += [history[i].prompt_array for i in repeated]
        lengths = [len(a) for a in seen]
        num_out = sum(lengths[: len(penalised)])
        num_seen = sum(lengths)
        bias_at = [i * vocab + t for i in rows for t, _ in params[i].logit_bias]
        biases = [b for i in rows for _, b in params[i].logit_bias]
        bias_at += [i * vocab + t for i in rows for t in banned[i]]
        biases += [-np.inf] * (len(bias_at) - len(biases))
        masked = [i for i in rows if params[i].allowed_token_ids is not None]
        allowed = [params[i].allowed_array for i in masked]
        allowed_at = num_seen + len(bias_at)
        masked_at = allowed_at + sum(len(a) for a in allowed)
        floats_at = masked_at + len(masked)
        words = np.empty(floats_at + (3 * n + len(biases) + 1) // 2, dtype=np.int64)
        if num_seen:
            np.concatenate(seen, out=words[:num_seen])
            offsets = np.asarray(penalised + repeated, dtype=np.int64) * vocab
            words[:num_seen] += np.repeat(offsets, lengths)
        words[num_seen:allowed_at] = bias_at
        if masked:
            np.concatenate(allowed, out=words[allowed_at:masked_at])
            offsets = np.asarray(masked, dtype=np.int64) * vocab
            words[allowed_at:masked_at] += np.repeat(offsets, [len(a) for a in allowed])
            words[masked_at:floats_at] = masked
        floats = words[floats_at:].view(np.float32)
        factors = floats[: 3 * n].reshape(n, 3)
        factors[:] = (1.0, 0.0, 0.0)
        if penalised:
            factors[penalised] = [
                (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
                for p in (params[i] for i in penalised)
            ]
        floats[3 * n : 3 * n + len(biases)] = biases
        return cls(words, num_seen, num_out, floats_at, len(biases), allowed_at, masked_at)


class _Staging:
    """Pinned host memory the plans cross to a CUDA device from, reused call after call
    (a copy from pageable memory first waits for the device to finish its queued work and
    stages through the driver's own buffer). Before the buffer is written again, the last
    copy out of it is waited for (it has long finished: each step ends in a host sync)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        self._lock = threading.Lock()

    def to_device(self, words: np.ndarray, device: torch.device) -> torch.Tensor:
        """int64 [k] on the host -> the same on `device` (CPU: the array itself, no copy)."""
        if device.type != "cuda":
            return torch.from_numpy(words)
        with self._lock:
            if self._copied is not None:
                self._copied.synchronize()
            have = 0 if self._buf is None else self._buf.numel()
            if have < len(words):  # doubling: pinning is slow, so rarely
                size = max(len(words), 2 * have, 1 << 16)
                self._buf = torch.empty(size, dtype=torch.int64).pin_memory()
            staged = self._buf[: len(words)]
            staged.numpy()[:] = words
            on_device = staged.to(device, non_blocking=True)  # on device's current stream
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(device))
            return on_device


_STAGING = _Staging()
