"""`n` choices: the field's validation, per-choice seeds and usage, and the n engine
requests one prepared request becomes."""

import pytest

from lora_core.errors import InvalidRequest
from lora_core.identity import AdapterRef
from replica.sampling_checks import SEED_MAX, SEED_MIN
from replica.sampling_params import SamplingParams
from replica.serve_protocol import GenerateCall
from router.body_parse import parse_body
from router.choices import MAX_N, N_ALLOWED, choice_params, choice_seed, total_usage
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from router.openai_responses import Usage
from router.prepared import Prepared

COMPLETION = {"model": "a", "prompt": "x"}
CHAT = {"model": "a", "messages": [{"role": "user", "content": "x"}]}
BODIES = [(CompletionRequest, COMPLETION), (ChatCompletionRequest, CHAT)]


@pytest.mark.parametrize("model, body", BODIES)
@pytest.mark.parametrize("n, want", [(1, 1), (2, 2), (MAX_N, MAX_N), (None, 1)])
def test_n_in_range_is_taken(model, body, n, want):
    assert parse_body(model, {**body, "n": n}).n == want


@pytest.mark.parametrize("model, body", BODIES)
@pytest.mark.parametrize("n", [0, -1, MAX_N + 1, 128])
def test_n_out_of_range_is_refused_naming_n(model, body, n):
    with pytest.raises(InvalidRequest) as e:
        parse_body(model, {**body, "n": n})
    assert str(e.value) == f"n: {n}; {N_ALLOWED}"
    assert N_ALLOWED == "allowed: an integer 1 to 16 (choices per request)"
    assert e.value.param == "n"


@pytest.mark.parametrize("model, body", BODIES)
@pytest.mark.parametrize("n", ["2", True, 2.0, [2], {"n": 2}])
def test_n_of_another_type_is_refused_naming_n(model, body, n):
    with pytest.raises(InvalidRequest) as e:
        parse_body(model, {**body, "n": n})
    assert str(e.value).startswith("n: got ") and str(e.value).endswith("allowed: an integer")
    assert e.value.param == "n"


@pytest.mark.parametrize(
    "seed, index, want",
    [
        (None, 0, None),
        (None, 5, None),
        (7, 0, 7),
        (7, 2, 9),
        (-1, 1, 0),
        (SEED_MAX, 0, SEED_MAX),
        (SEED_MAX, 1, SEED_MIN),
        (SEED_MAX - 1, 3, SEED_MIN + 1),
        (SEED_MIN, MAX_N - 1, SEED_MIN + MAX_N - 1),
    ],
)
def test_choice_seed_is_seed_plus_index_wrapped_to_int64(seed, index, want):
    assert choice_seed(seed, index) == want


@pytest.mark.parametrize("seed", [SEED_MIN, -3, 0, SEED_MAX - 5, SEED_MAX])
def test_the_seeds_of_one_response_differ_and_are_valid(seed):
    params = [choice_params(SamplingParams(seed=seed, temperature=0.7), i) for i in range(MAX_N)]
    assert len({p.seed for p in params}) == MAX_N
    assert all(SEED_MIN <= p.seed <= SEED_MAX for p in params)
    assert {p.temperature for p in params} == {0.7}


def test_usage_counts_the_prompt_once_and_sums_completions():
    assert total_usage([Usage(5, 3), Usage(5, 4), Usage(5, 0)]) == Usage(5, 7)
    assert total_usage([Usage(0, 0), Usage(5, 2)]) == Usage(5, 2)
    assert total_usage([Usage(5, 3)]).to_dict() == {
        "prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
    }  # fmt: skip


def prepared(seed):
    ref = AdapterRef("a1", 1, "ab" * 32, "/a/a1", 8, "base")
    params = SamplingParams(max_tokens=4, seed=seed)
    call = GenerateCall("req-abc", (1, 2, 3), params, ref, (("r1", "gpu"),))
    return Prepared(call, "a1", ref)


def test_one_choice_is_the_request_itself():
    p = prepared(7)
    assert p.choices(1) == [p]


@pytest.mark.parametrize("seed, seeds", [(7, [7, 8, 9]), (None, [None, None, None])])
def test_n_choices_are_n_calls_of_one_prompt_with_own_ids_and_seeds(seed, seeds):
    p = prepared(seed)
    calls = [c.call for c in p.choices(3)]
    assert [c.request_id for c in calls] == ["req-abc-0", "req-abc-1", "req-abc-2"]
    assert [c.params.seed for c in calls] == seeds
    assert {(c.prompt_token_ids, c.adapter, c.residency) for c in calls} == {
        ((1, 2, 3), p.adapter, (("r1", "gpu"),))
    }
    assert {c.params.max_tokens for c in calls} == {4}
