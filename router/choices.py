"""`n` choices of one OpenAI request: the cap, per-choice seeds and usage (pure).

The ingress answers `n` > 1 by sending n independent engine requests (one per choice)
of the same tokenized prompt and merging their outputs; this module holds the rules
that decide what each choice samples with and what the response counts.

Seeds: with `seed` s, choice i samples with seed s + i, wrapped into the signed 64-bit
range `SamplingParams` accepts (two's complement: SEED_MAX + 1 wraps to SEED_MIN).
Choice 0 of any n therefore answers exactly like the same request with n = 1, every
choice of a response draws from its own stream (the choices differ), and the same
request repeats the same response. Without a seed every choice draws independently.
Greedy (temperature 0) choices are equal, as with OpenAI and vLLM.

Prompt scores: with `prompt_logprobs` (completions' echo with logprobs) every choice asks
for them, but a replica computes them only for the first choice of a request it queues;
the others take the prompt's blocks from its prefix cache instead (`replica.async_engine`)
and the ingress echoes the scores of the one that computed them (`router.rest`).

Usage counts the prompt once (one prompt, however many samples of it) and sums the
completion tokens of all choices (OpenAI bills "generated tokens across all choices").

Batched prompts (completions' `prompt` as a list of strings or of token-id lists, as
OpenAI, vLLM and lm-evaluation-harness send it) fan out the same way: prompt i's choice j
is the response's choice i * n + j, and usage sums each prompt's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from replica.sampling_checks import SEED_MAX, SEED_MIN, is_int
from replica.sampling_params import SamplingParams
from router.openai_responses import Usage

MAX_N = 16
"""Most choices per request. Each choice is a whole engine request on a replica (its
own KV blocks and one of the replica's `max_ongoing_requests`, 32 by default): a cap of
16 lets one request take at most half of a default replica's concurrency, where
OpenAI's 128 would let one client fill four replicas with one call."""
N_ALLOWED = f"allowed: an integer 1 to {MAX_N} (choices per request)"


def check_n(n: int) -> int:
    """The `n` field of a body (pydantic has already refused non-integers)."""
    if not (is_int(n) and 1 <= n <= MAX_N):
        raise ValueError(f"{n!r}; {N_ALLOWED}")
    return n


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request seeded `seed` (None: unseeded).
    Example: choice_seed(7, 2) == 9; choice_seed(SEED_MAX, 1) == SEED_MIN."""
    if seed is None:
        return None
    span = SEED_MAX - SEED_MIN + 1
    return (seed + index - SEED_MIN) % span + SEED_MIN


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """`params` for choice `index`: the same but for its seed."""
    return dataclasses.replace(params, seed=choice_seed(params.seed, index))


MAX_PROMPTS = 64
"""Most prompts per batched completion, and most engine requests (prompts x n) per
request: like MAX_N, it bounds what one call can take of the replicas."""
PROMPT_ALLOWED = (
    "allowed: a string, a list of token ids, or a batch of at most "
    f"{MAX_PROMPTS} prompts (a list of strings, or a list of token-id lists)"
)


def check_prompt(prompt: object) -> object:
    """completions' `prompt`: a string, a token-id list, or a non-empty batch of strings
    or of token-id lists (JSON true is no token id)."""
    if isinstance(prompt, str) or _ids(prompt):
        return prompt
    if isinstance(prompt, list) and 0 < len(prompt) <= MAX_PROMPTS:
        if all(isinstance(p, str) for p in prompt) or all(_ids(p) for p in prompt):
            return prompt
    raise ValueError(PROMPT_ALLOWED)


def _ids(x: object) -> bool:
    return isinstance(x, list) and all(is_int(t) for t in x)


def batch_of(prompt: str | list) -> list[str | list[int]]:
    """The prompts of a checked `prompt`: one (a string or a token-id list), or the batch."""
    if isinstance(prompt, str) or _ids(prompt):
        return [prompt]
    return prompt


def check_fan_out(prompts: int, n: int) -> None:
    """Refuse more than MAX_PROMPTS engine requests for one request."""
    if prompts * n > MAX_PROMPTS:
        raise ValueError(
            f"n: {prompts} prompts x n = {n} is {prompts * n} samples; allowed: at most "
            f"{MAX_PROMPTS} per request (prompts x n)"
        )


def batch_usage(per_choice: Sequence[Usage], n: int) -> Usage:
    """The response's usage of a batch of prompts with n choices each (prompt i's are
    per_choice[i * n : i * n + n]): each prompt's `total_usage`, summed."""
    usages = [total_usage(per_choice[i : i + n]) for i in range(0, len(per_choice), n)]
    return Usage(sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages))


def total_usage(per_choice: Sequence[Usage]) -> Usage:
    """The response's usage from each choice's own. Example: (5, 3) and (5, 4) -> (5, 7)."""
    # every choice has the same prompt; max() skips a choice that has no counts yet
    prompt = max(u.prompt_tokens for u in per_choice)
    return Usage(prompt, sum(u.completion_tokens for u in per_choice))
