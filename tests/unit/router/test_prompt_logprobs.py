"""vLLM's prompt_logprobs shape from the engine's prompt scores (pure, on the demo
byte-level BPE tokenizer): null for the first token, then per token an object keyed by
token id of {logprob, rank, decoded_token}, the prompt token first with its own rank,
the k most likely next ranked 1..k; -inf clamped as vLLM does."""

from __future__ import annotations

import json

import pytest

from replica.outputs import RequestOutput
from router.logprobs import TokenTable
from router.prompt_logprobs import LOGPROB_FLOOR, prompt_logprobs_json
from tests.unit.router.test_frontend_auth import tokenizer

__all__ = ["tokenizer"]  # the module fixture, shared


def scored(lps, ranks, tops=None) -> RequestOutput:
    return RequestOutput("r", prompt_logprobs=lps, prompt_ranks=ranks, prompt_top_logprobs=tops)


def entry(table: TokenTable, token: int, logprob: float, rank: int) -> dict:
    return {"logprob": logprob, "rank": rank, "decoded_token": table[token].text}


def test_each_prompt_token_then_the_k_most_likely_ranked_1_to_k(tokenizer):
    table = TokenTable(tokenizer)
    ids = [5, 40, 41]
    out = scored([-2.5, -0.5], [4, 2], [((60, -0.1), (61, -0.2)), ((62, -0.3), (41, -0.5))])
    got = prompt_logprobs_json(ids, out, 2, table)
    assert got == [
        None,
        {
            "40": entry(table, 40, -2.5, 4),
            "60": entry(table, 60, -0.1, 1),
            "61": entry(table, 61, -0.2, 2),
        },
        # the prompt token among the top: first in the object, with its top rank
        {"41": entry(table, 41, -0.5, 2), "62": entry(table, 62, -0.3, 1)},
    ]
    assert list(got[2]) == ["41", "62"]
    assert got[1]["40"]["decoded_token"] == tokenizer.decode([40])
    assert json.loads(json.dumps(got)) == got  # keys are JSON's strings already


def test_k_cuts_what_the_engine_scored_for_a_larger_k(tokenizer):
    table = TokenTable(tokenizer)
    out = scored([-1.0], [3], [((7, -0.1), (8, -0.2), (9, -0.3))])
    assert prompt_logprobs_json([5, 6], out, 1, table) == [
        None,
        {"6": entry(table, 6, -1.0, 3), "7": entry(table, 7, -0.1, 1)},
    ]
    zero = scored([-1.0], [3])  # k 0: the engine sends no tops
    assert prompt_logprobs_json([5, 6], zero, 0, table) == [None, {"6": entry(table, 6, -1.0, 3)}]


def test_minus_infinity_is_sent_as_vllms_floor(tokenizer):
    table = TokenTable(tokenizer)
    out = scored([float("-inf")], [9], [((7, -0.1), (8, float("-inf")))])
    (_, got) = prompt_logprobs_json([5, 6], out, 2, table)
    assert [v["logprob"] for v in got.values()] == [LOGPROB_FLOOR, -0.1, LOGPROB_FLOOR]
    json.dumps(got, allow_nan=False)


@pytest.mark.parametrize(
    "ids, out, want",
    [
        ([5], scored([], [], []), [None]),  # one token: nothing scores it
        ([5, 6], None, None),  # no output carried scores
        ([5, 6], RequestOutput("r"), None),
    ],
)
def test_a_prompt_without_scores(tokenizer, ids, out, want):
    assert prompt_logprobs_json(ids, out, 1, TokenTable(tokenizer)) == want
