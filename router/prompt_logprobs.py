"""vLLM's `prompt_logprobs` response field: the scores of a prompt's tokens (pure).

Completions put it on each choice (`choices[i].prompt_logprobs`, the scores of that
choice's prompt), chat on the response (`prompt_logprobs`), as vLLM's OpenAI server does.
Its shape is vLLM's `PromptLogprobs` as that server serializes it: one entry per prompt
token, null for the first (no token comes before it), for every other an object keyed by
token id (a decimal string: JSON keys are strings) of {"logprob", "rank",
"decoded_token"}: the prompt token first, with its rank in the distribution at its
position, then the k most likely tokens there, ranked 1 to k. A prompt token among them
keeps its first place in the object and takes its top-k rank (vLLM builds the dict the
same way). Example, prompt [5, 7] with k 1, where " b" (7) has logprob -2.5 and ranks 4th
and " c" (9) is the most likely:

    [null, {"7": {"logprob": -2.5, "rank": 4, "decoded_token": " b"},
            "9": {"logprob": -0.1, "rank": 1, "decoded_token": " c"}}]

A logprob of -inf is sent as -9999.0, vLLM's clamp (JSON has no infinity). decoded_token
is the token's string as the other logprobs of the API show it (`TokenTable`: a piece of
a multi-byte character is spelled "bytes:\\xNN").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from replica.outputs import RequestOutput
from router.logprobs import LOGPROB_FLOOR, TokenTable

PromptLogprobs = list[dict[str, dict[str, Any]] | None]


def prompt_logprobs_json(
    ids: Sequence[int], scored: RequestOutput | None, k: int, table: TokenTable
) -> PromptLogprobs | None:
    """The prompt_logprobs of prompt `ids`, from `scored`, the output that carries their
    scores (`RequestOutput.prompt_logprobs`, `prompt_ranks`, `prompt_top_logprobs`), with
    at most k top tokens per position (the engine may have scored more, for an echo's
    logprobs). None when no output carried them."""
    if scored is None or scored.prompt_logprobs is None:
        return None
    lps = scored.prompt_logprobs
    ranks = scored.prompt_ranks
    tops = scored.prompt_top_logprobs or [()] * len(lps)
    entries: PromptLogprobs = [None]
    for token, logprob, rank, top in zip(ids[1:], lps, ranks, tops, strict=True):
        entry = {str(token): _logprob(table, token, logprob, rank)}
        for top_rank, (other, other_logprob) in enumerate(top[:k], start=1):
            entry[str(other)] = _logprob(table, other, other_logprob, top_rank)
        entries.append(entry)
    return entries


def _logprob(table: TokenTable, token: int, logprob: float, rank: int) -> dict[str, Any]:
    return {
        "logprob": max(logprob, LOGPROB_FLOOR),
        "rank": rank,
        "decoded_token": table[token].text,
    }
