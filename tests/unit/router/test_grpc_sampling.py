"""gRPC request -> SamplingParams: float32 fields read as REST's decimals would be."""

import pytest

from lora_core.errors import InvalidRequest
from replica.logit_bias import LOGIT_BIAS_ALLOWED
from replica.sampling_checks import ALLOWED_TOKEN_IDS_ALLOWED, STOP_TOKEN_IDS_ALLOWED
from replica.sampling_params import SamplingParams
from router.grpc_service import sampling_of, shortest
from router.proto import lorafleet_pb2 as pb


@pytest.mark.parametrize("x", [0.0, 0.1, 0.7, 0.95, 1.0, 2.0, 2.01, 1e-7, 123.456])
def test_shortest_reads_float32_back_as_the_decimal_sent(x):
    sent = pb.GenerateRequest(temperature=x).temperature
    assert sent != x or x in (0.0, 1.0, 2.0)
    assert shortest(sent) == x


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"temperature": 2.01}, "temperature=2.01; allowed: 0 <= temperature <= 2"),
        ({"top_p": 1.1}, "top_p=1.1; allowed: 0 < top_p <= 1"),
        (
            {"presence_penalty": 2.1},
            "presence_penalty=2.1; allowed: a number -2 <= presence_penalty <= 2 (0 = off)",
        ),
        (
            {"frequency_penalty": -2.5},
            "frequency_penalty=-2.5; allowed: a number -2 <= frequency_penalty <= 2 (0 = off)",
        ),
        (
            {"repetition_penalty": 0.0},
            "repetition_penalty=0.0; allowed: a number 0 < repetition_penalty <= 2 (1 = off)",
        ),
        (
            {"repetition_penalty": 2.2},
            "repetition_penalty=2.2; allowed: a number 0 < repetition_penalty <= 2 (1 = off)",
        ),
        (
            {"top_k": -3},
            "top_k=-3; allowed: an integer >= 0 (0 = off), or -1 (off, as in vLLM)",
        ),
        ({"logit_bias": {7: 100.5}}, f"logit_bias: bias 100.5 for token 7; {LOGIT_BIAS_ALLOWED}"),
        (
            {"logit_bias": {i: 1.0 for i in range(301)}},
            f"logit_bias: 301 token ids; {LOGIT_BIAS_ALLOWED}",
        ),
        (
            {"min_tokens": 3},
            "min_tokens=3 with max_tokens=2; allowed: an integer 0 <= min_tokens <= max_tokens",
        ),
        (
            {"stop_token_ids": list(range(65))},
            f"stop_token_ids: {STOP_TOKEN_IDS_ALLOWED}; got (0, 1, 2, 3, 4, 5, 6, 7, ...)",
        ),
        ({"min_p": 1.5}, "min_p=1.5; allowed: a number 0 <= min_p <= 1 (0 = off)"),
        (
            {"ignore_eos": True, "structured_regex": "a+"},
            "ignore_eos: true with structured outputs; allowed: false (the grammar ends the "
            "output with EOS)",
        ),
        ({"min_p": -0.1}, "min_p=-0.1; allowed: a number 0 <= min_p <= 1 (0 = off)"),
        (
            {"allowed_token_ids": [0] * 262_145},
            f"allowed_token_ids: 262145 token ids; {ALLOWED_TOKEN_IDS_ALLOWED}",
        ),
    ],
)
def test_grpc_messages_match_rest(fields, message):
    with pytest.raises(InvalidRequest) as e:
        sampling_of(pb.GenerateRequest(max_tokens=2, **fields))
    assert (str(e.value), e.value.param) == (message, next(iter(fields)))


def test_sampling_of_keeps_the_values():
    params = sampling_of(pb.GenerateRequest(temperature=0.7, top_p=0.9))
    assert (params.temperature, params.top_p, params.max_tokens) == (0.7, 0.9, 16)


def test_penalties_top_k_and_logit_bias_are_mapped():
    req = pb.GenerateRequest(
        min_tokens=3,
        stop_token_ids=[9, 4],
        presence_penalty=-1.3,
        frequency_penalty=0.7,
        repetition_penalty=1.2,
        top_k=40,
        logit_bias={50256: -100.0, 7: 2.1},
    )
    assert sampling_of(req) == SamplingParams(
        temperature=0.0,
        presence_penalty=-1.3,
        frequency_penalty=0.7,
        repetition_penalty=1.2,
        top_k=40,
        logit_bias=((7, 2.1), (50256, -100.0)),
        min_tokens=3,
        stop_token_ids=(9, 4),
    )


def test_min_p_and_allowed_token_ids_are_mapped():
    params = sampling_of(pb.GenerateRequest(min_p=0.1, allowed_token_ids=[9, 2, 9]))
    assert (params.min_p, params.allowed_token_ids) == (0.1, (2, 9))
    params = sampling_of(pb.GenerateRequest())
    assert (params.min_p, params.allowed_token_ids) == (0.0, None)  # empty: off


@pytest.mark.parametrize("top_k", [0, -1])
def test_unset_and_zero_fields_mean_off(top_k):
    params = sampling_of(pb.GenerateRequest(top_k=top_k))
    assert params == SamplingParams(temperature=0.0) and not params.processes_logits


def test_logprobs_map_to_sampling_params_and_chunks():
    from replica.outputs import RequestOutput
    from router.grpc_service import chunk_of

    assert sampling_of(pb.GenerateRequest()).logprobs is False
    params = sampling_of(pb.GenerateRequest(logprobs=0))
    assert (params.logprobs, params.top_logprobs) == (True, 0)
    params = sampling_of(pb.GenerateRequest(logprobs=3))
    assert (params.logprobs, params.top_logprobs) == (True, 3)
    with pytest.raises(InvalidRequest) as e:
        sampling_of(pb.GenerateRequest(logprobs=21))
    assert (str(e.value), e.value.param) == (
        "logprobs: 21 is out of range; allowed: 0 to 20",
        "logprobs",
    )
    out = RequestOutput("r", [5, 6], "ab", [-0.5, -1.25], [((5, -0.5), (9, -2.0)), ((6, -1.25),)])
    chunk = chunk_of(0, out, (1, 2))
    assert [lp.logprob for lp in chunk.logprobs] == [-0.5, -1.25]
    assert [[(t.token_id, t.logprob) for t in lp.top] for lp in chunk.logprobs] == [
        [(5, -0.5), (9, -2.0)],
        [(6, -1.25)],
    ]
    assert not chunk_of(0, RequestOutput("r", [5], "a"), (1, 2)).logprobs
    assert not chunk.prompt_token_ids and not chunk.prompt_logprobs


@pytest.mark.parametrize("k", [0, 3, 20])
def test_prompt_logprobs_k_maps_to_sampling_params(k):
    assert sampling_of(pb.GenerateRequest()).prompt_logprobs is None
    params = sampling_of(pb.GenerateRequest(prompt_logprobs=k))
    assert (params.prompt_logprobs, params.logprobs, params.max_tokens) == (k, False, 16)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"prompt_logprobs": 21}, "prompt_logprobs: 21 is out of range; allowed: 0 to 20"),
        (
            {"prompt_logprobs": 2**32 - 1},
            "prompt_logprobs: 4294967295 is out of range; allowed: 0 to 20",
        ),
        (
            {"max_tokens": 0},
            "max_tokens: got 0; allowed: an integer >= 1, or 0 with prompt_logprobs set (the "
            "prompt only, e.g. to score it with logprobs)",
        ),
        (
            {"max_tokens": 0, "logprobs": 1},
            "max_tokens: got 0; allowed: an integer >= 1, or 0 with prompt_logprobs set (the "
            "prompt only, e.g. to score it with logprobs)",
        ),
    ],
)
def test_prompt_logprobs_and_max_tokens_0_are_checked_as_rest_checks_them(fields, message):
    with pytest.raises(InvalidRequest) as e:
        sampling_of(pb.GenerateRequest(**fields))
    assert (str(e.value), e.value.param) == (message, next(iter(fields)))


@pytest.mark.parametrize("k", [0, 2])
def test_max_tokens_0_with_prompt_logprobs_scores_the_prompt_only(k):
    params = sampling_of(pb.GenerateRequest(max_tokens=0, prompt_logprobs=k))
    assert (params.max_tokens, params.prompt_logprobs) == (0, k)
    assert sampling_of(pb.GenerateRequest(max_tokens=5)).max_tokens == 5


def test_the_first_chunk_carries_the_prompt_ids_and_scores():
    from replica.outputs import RequestOutput
    from router.grpc_service import chunk_of

    out = RequestOutput("r", finish_reason="length", num_prompt_tokens=3)
    out.prompt_logprobs = [-1.5, -0.25]
    out.prompt_top_logprobs = [((4, -0.5), (8, -1.5)), ((9, -0.25), (1, -3.0))]
    chunk = chunk_of(2, out, (7, 8, 9))
    assert (chunk.index, chunk.finish_reason, list(chunk.token_ids)) == (2, "length", [])
    assert list(chunk.prompt_token_ids) == [7, 8, 9]
    assert [t.logprob for t in chunk.prompt_logprobs] == [-1.5, -0.25]
    assert [[(t.token_id, t.logprob) for t in lp.top] for lp in chunk.prompt_logprobs] == [
        [(4, -0.5), (8, -1.5)],
        [(9, -0.25), (1, -3.0)],
    ]
    out.prompt_top_logprobs = None  # k = 0: the logprobs alone
    assert [list(t.top) for t in chunk_of(0, out, (7, 8, 9)).prompt_logprobs] == [[], []]
    out.prompt_logprobs = []  # a prompt of one token has nothing to score
    chunk = chunk_of(0, out, (7,))
    assert list(chunk.prompt_token_ids) == [7] and not chunk.prompt_logprobs


def test_choices_without_prompt_scores_wait_for_and_send_the_scoring_choices():
    """A replica scores the prompt for one choice of a group: the others' first chunks
    carry that choice's scores, and nothing of theirs goes out before them."""
    import asyncio

    from replica.outputs import RequestOutput
    from router.grpc_service import chunk_of, shared_prompt_scores

    scorer = RequestOutput("r-0", [5], "a")
    scorer.prompt_logprobs = [-1.0, -2.0]
    arrivals = [
        (1, RequestOutput("r-1", [6], "b")),  # a follower's first output, before the scores
        (1, RequestOutput("r-1", [7], "c")),
        (0, scorer),
        (0, RequestOutput("r-0", [8], "d")),
        (2, RequestOutput("r-2", [9], "e")),  # a follower arriving after them
    ]

    async def merged():
        for item in arrivals:
            yield item

    async def run():
        return [
            (i, o.new_text, chunk_of(i, o, (3, 4, 5), s))
            async for i, o, s in shared_prompt_scores(merged())
        ]

    sent = asyncio.run(run())
    assert [(i, text) for i, text, _ in sent] == [(1, "b"), (1, "c"), (0, "a"), (0, "d"), (2, "e")]
    scores = {text: [t.logprob for t in c.prompt_logprobs] for _, text, c in sent}
    assert scores == {"b": [-1.0, -2.0], "c": [], "a": [-1.0, -2.0], "d": [], "e": [-1.0, -2.0]}
    ids = {text: list(c.prompt_token_ids) for _, text, c in sent}
    assert ids["b"] == ids["a"] == ids["e"] == [3, 4, 5] and ids["c"] == ids["d"] == []


@pytest.mark.parametrize(
    "fields, want",
    [
        ({}, {}),  # unset: as before the fields existed
        ({"include_stop_str_in_output": True}, {"include_stop_str_in_output": True}),
        ({"skip_special_tokens": True}, {}),
        ({"skip_special_tokens": False}, {"skip_special_tokens": False}),
        ({"truncate_prompt_tokens": 5}, {"truncate_prompt_tokens": 5}),
        ({"truncate_prompt_tokens": -1}, {"truncate_prompt_tokens": -1}),
        ({"ignore_eos": True}, {"ignore_eos": True}),
    ],
)
def test_stop_string_special_token_and_truncation_fields_are_mapped(fields, want):
    assert sampling_of(pb.GenerateRequest(**fields)) == SamplingParams(temperature=0.0, **want)


@pytest.mark.parametrize("k", [0, -2])
def test_a_bad_truncation_is_refused_as_rest_refuses_it(k):
    from replica.prompt_truncation import TRUNCATE_ALLOWED

    with pytest.raises(InvalidRequest) as e:
        sampling_of(pb.GenerateRequest(truncate_prompt_tokens=k))
    assert (str(e.value), e.value.param) == (
        f"truncate_prompt_tokens={k}; {TRUNCATE_ALLOWED}",
        "truncate_prompt_tokens",
    )
