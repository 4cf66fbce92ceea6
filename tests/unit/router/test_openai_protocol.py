import asyncio
import json
import time

import pytest

from lora_core.errors import InvalidRequest
from replica.sampling_params import SamplingParams
from router.admin_bodies import AdapterNameRequest, LoadAdapterRequest, WarmAdapterRequest
from router.body_parse import BIG_BODY, param_of_check, parse_body, parse_request
from router.choices import PROMPT_ALLOWED
from router.openai_protocol import ChatCompletionRequest, CompletionRequest

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
ROOM = 1000
"""Chat's default max_tokens in these tests: the room a prompt leaves in the context."""
USER_X = {"role": "user", "content": "x"}


def sampling(model, body) -> SamplingParams:
    """What the REST handlers do: parse the body, then build the sampling parameters."""
    req = parse_body(model, body)
    if isinstance(req, ChatCompletionRequest):
        return req.to_sampling_params(ROOM)
    return req.to_sampling_params()


def test_completion_fields_map_to_sampling_params():
    req = parse_body(
        CompletionRequest,
        b'{"model": "a", "prompt": "hi", "max_tokens": 5, "temperature": 0, "top_p": 0.5,'
        b' "seed": 7, "stop": "x", "logprobs": 1, "user": "u", "unknown_field": 3}',
    )
    assert req.prompt == "hi"
    assert req.to_sampling_params() == SamplingParams(
        max_tokens=5,
        temperature=0.0,
        top_p=0.5,
        seed=7,
        stop=("x",),
        logprobs=True,
        top_logprobs=1,
    )


ZERO_ALLOWED = (
    "allowed: an integer >= 1, or 0 with echo: true or prompt_logprobs set (the prompt "
    "only, e.g. to score it with logprobs)"
)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"max_tokens": 0}, f"max_tokens: got 0; {ZERO_ALLOWED}"),
        ({"max_tokens": 0, "echo": False}, f"max_tokens: got 0; {ZERO_ALLOWED}"),
        ({"max_tokens": -1, "echo": True}, f"max_tokens: got -1; {ZERO_ALLOWED}"),
    ],
)
def test_max_tokens_zero_only_with_echo_or_prompt_logprobs(fields, message):
    with pytest.raises(InvalidRequest) as e:
        parse_body(CompletionRequest, {"model": "a", "prompt": "x", **fields})
    assert (str(e.value), e.value.param) == (message, "max_tokens")
    req = parse_body(
        CompletionRequest, {"model": "a", "prompt": "x", "max_tokens": 0, "echo": True}
    )
    assert req.to_sampling_params() == SamplingParams(max_tokens=0)
    req = parse_body(
        CompletionRequest, {"model": "a", "prompt": "x", "max_tokens": 0, "prompt_logprobs": 0}
    )
    assert req.to_sampling_params() == SamplingParams(max_tokens=0, prompt_logprobs=0)


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_min_tokens_and_stop_token_ids_map_to_sampling_params(model):
    body = {"model": "a", "min_tokens": 2, "stop_token_ids": [7, 3], "max_tokens": 5}
    body |= {"prompt": "x"} if model is CompletionRequest else {"messages": [USER_X]}
    params = sampling(model, body)
    assert (params.min_tokens, params.stop_token_ids) == (2, (7, 3))
    for bad, message in (
        ({"stop_token_ids": ["7"]}, "stop_token_ids.0: got a string"),
        ({"min_tokens": 6}, "min_tokens=6 with max_tokens=5; allowed"),
        ({"min_tokens": "2"}, "min_tokens: got a string"),
    ):
        with pytest.raises(InvalidRequest) as e:
            sampling(model, body | bad)
        assert str(e.value).startswith(message)


def test_completion_defaults():
    req = parse_body(CompletionRequest, {"model": "a", "prompt": [1, 2, 3]})
    assert req.prompt == [1, 2, 3]
    assert not req.stream and not req.include_usage
    assert req.to_sampling_params() == SamplingParams(max_tokens=16)


@pytest.mark.parametrize(
    "body, where",
    [
        (b"{not json", "JSON"),
        (b"[1, 2]", "JSON object"),
        ({"prompt": "x"}, "model"),
        ({"model": "", "prompt": "x"}, "model"),
        ({"model": "a"}, "prompt"),
        ({"model": "a", "prompt": ["a", [2]]}, "prompt"),
        ({"model": "a", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "a", "prompt": "x", "temperature": 2.5}, "temperature"),
        ({"model": "a", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "a", "prompt": "x", "n": 17}, "n"),
        (
            {"model": "a", "prompt": "x", "logprobs": 21},
            "logprobs: 21 is out of range; allowed: 0 to 20",
        ),
        (
            {"model": "a", "prompt": "x", "logprobs": -1},
            "logprobs: -1 is out of range; allowed: 0 to 20",
        ),
        ({"model": "a", "prompt": "x", "echo": "yes"}, "echo"),
        ({"model": "a", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "a", "prompt": "x", "seed": "s"}, "seed"),
        ({"model": "a", "prompt": "x", "stop": [1]}, "stop"),
        ({"model": "a", "prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"model": "a", "prompt": "x", "max_tokens": "2"}, "max_tokens"),
        ({"model": "a", "prompt": "x", "max_tokens": 2.0}, "max_tokens"),
        ({"model": "a", "prompt": "x", "temperature": "0.5"}, "temperature"),
        ({"model": "a", "prompt": "x", "stream": "true"}, "stream"),
        ({"model": "a", "prompt": "x", "seed": True}, "seed"),
        ({"model": "a", "prompt": "x", "best_of": 2}, "best_of"),
        ({"model": "a", "prompt": "x", "suffix": "tail"}, "suffix"),
        (
            {"model": "a", "prompt": "x", "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        (
            {"model": "a", "prompt": "x", "stream": False, "stream_options": {}},
            "stream_options",
        ),
        ({"model": "a", "prompt": [1, True]}, "prompt"),
    ],
)
def test_completion_rejects_bad_input_naming_the_field(body, where):
    with pytest.raises(InvalidRequest) as e:
        sampling(CompletionRequest, body)
    assert where in str(e.value)


@pytest.mark.parametrize("seed", [2**64, INT64_MIN - 1, 2**70, INT64_MAX + 1])
@pytest.mark.parametrize("stream", [False, True])
def test_seed_outside_int64_is_refused_naming_the_range(seed, stream):
    body = {"model": "a", "prompt": "x", "seed": seed, "stream": stream}
    with pytest.raises(InvalidRequest) as e:
        sampling(CompletionRequest, body)
    assert str(e.value) == (
        f"seed={seed}; allowed: null or an integer in {INT64_MIN} .. {INT64_MAX} (signed 64-bit)"
    )


@pytest.mark.parametrize(
    "field, value",
    [("temperature", 10**400), ("presence_penalty", -(10**309)), ("logit_bias", {"5": 2**1024})],
    ids=["temperature", "presence_penalty", "logit_bias"],
)
def test_an_integer_beyond_a_floats_range_is_no_type_error(field, value):
    # pydantic calls it "not a valid number"; "got a number; allowed: a number" read as a
    # contradiction: say how long it is and what range a number field takes
    with pytest.raises(InvalidRequest) as e:
        parse_body(CompletionRequest, {"model": "a", "prompt": "x", field: value})
    digits = len(str(abs(value if isinstance(value, int) else value["5"])))
    loc = "logit_bias.5" if field == "logit_bias" else field
    assert (str(e.value), e.value.param) == (
        f"{loc}: got a number of {digits} digits; allowed: a number from -1.798e+308 to 1.798e+308",
        loc,
    )


@pytest.mark.parametrize("seed", [INT64_MIN, -1, 0, INT64_MAX])
def test_seed_range_is_int64(seed):
    assert sampling(CompletionRequest, {"model": "a", "prompt": "x", "seed": seed}).seed == seed


@pytest.mark.parametrize(
    "prompt",
    [["a", [1]], [[1, True]], [["a"]], {"text": "x"}, 3, ["a"] * 65, [[1]] * 65, [1, "a"]],
)
def test_odd_prompts_get_one_clear_message(prompt):
    with pytest.raises(InvalidRequest) as e:
        parse_body(CompletionRequest, {"model": "a", "prompt": prompt})
    assert str(e.value) == f"prompt: {PROMPT_ALLOWED}"


@pytest.mark.parametrize(
    "prompt, batch",
    [("x", ["x"]), ([1, 2], [[1, 2]]), (["a", "b"], ["a", "b"]), ([[1, 2], [3]], [[1, 2], [3]])],
)
def test_a_prompt_or_a_batch_of_them(prompt, batch):
    from router.choices import batch_of

    assert batch_of(parse_body(CompletionRequest, {"model": "a", "prompt": prompt}).prompt) == batch


def test_prompts_times_n_is_bounded():
    parse_body(CompletionRequest, {"model": "a", "prompt": ["x"] * 4, "n": 16})
    with pytest.raises(InvalidRequest) as e:
        parse_body(CompletionRequest, {"model": "a", "prompt": ["x"] * 5, "n": 13})
    assert (str(e.value), e.value.param) == (
        "n: 5 prompts x n = 13 is 65 samples; allowed: at most 64 per request (prompts x n)",
        "n",
    )


NULLS = ["temperature", "top_p", "seed", "stop", "user", "stream", "stream_options", "n"]


def test_null_means_the_default():
    nulls = dict.fromkeys(NULLS + ["max_tokens", "logprobs", "echo", "best_of", "suffix"])
    req = parse_body(CompletionRequest, {"model": "a", "prompt": "x", **nulls})
    assert not req.stream and req.to_sampling_params() == SamplingParams(max_tokens=16)
    chat = {"model": "a", "messages": [{"role": "user", "content": "x"}]}
    nulls = dict.fromkeys(NULLS + ["max_tokens", "max_completion_tokens", "top_logprobs"])
    req = parse_body(ChatCompletionRequest, {**chat, **nulls})
    assert req.to_sampling_params(ROOM) == SamplingParams(max_tokens=ROOM)


def test_unsupported_fields_at_their_neutral_value_are_accepted():
    body = {"model": "a", "prompt": "x", "best_of": 1, "suffix": "", "n": 1, "echo": False}
    assert sampling(CompletionRequest, body) == SamplingParams(max_tokens=16)
    body = {"model": "a", "prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    assert parse_body(CompletionRequest, body).include_usage


def test_chat_request_messages_and_max_completion_tokens():
    req = parse_body(
        ChatCompletionRequest,
        {
            "model": "a",
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "he"}, {"type": "text", "text": "llo"}],
                },
            ],
            "max_completion_tokens": 9,
            "logprobs": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert req.chat_dicts() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "he\nllo"},  # vLLM's join: one line per text part
    ]
    assert req.to_sampling_params(ROOM).max_tokens == 9
    assert req.to_sampling_params(ROOM).logprobs
    assert req.include_usage


@pytest.mark.parametrize(
    "body, where",
    [
        ({"model": "a", "messages": []}, "messages"),
        ({"model": "a", "messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"model": "a", "messages": [{"role": "user"}]}, "content"),
        (
            {"model": "a", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 21},
            "top_logprobs: 21 is out of range; allowed: 0 to 20",
        ),
        ({"model": "a", "messages": [{"role": "user", "content": None}]}, "content"),
        (
            {"model": "a", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            "max_tokens",
        ),
        (
            {"model": "a", "messages": [{"role": "user", "content": "x"}], "logprobs": 1},
            "logprobs",
        ),
    ],
)
def test_chat_rejects_bad_input(body, where):
    with pytest.raises(InvalidRequest) as e:
        sampling(ChatCompletionRequest, body)
    assert where in str(e.value)


def test_chat_assistant_content_null_reads_as_empty():
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "again"},
    ]
    req = parse_body(ChatCompletionRequest, {"model": "a", "messages": messages})
    assert [m["content"] for m in req.chat_dicts()] == ["hi", "", "again"]


@pytest.mark.parametrize("k", [0, 1, 20])
def test_top_logprobs_map_to_sampling_params(k):
    msgs = [{"role": "user", "content": "x"}]
    chat = parse_body(
        ChatCompletionRequest,
        {"model": "a", "messages": msgs, "logprobs": True, "top_logprobs": k},
    )
    params = chat.to_sampling_params(ROOM)
    assert (params.logprobs, params.top_logprobs) == (True, k)
    comp = parse_body(CompletionRequest, {"model": "a", "prompt": "x", "logprobs": k})
    assert (comp.to_sampling_params().logprobs, comp.to_sampling_params().top_logprobs) == (True, k)


def test_chat_top_logprobs_need_logprobs():
    body = {"model": "a", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    req = parse_body(ChatCompletionRequest, body)
    with pytest.raises(InvalidRequest, match="top_logprobs=2 needs logprobs"):
        req.to_sampling_params(ROOM)


def test_load_adapter_body_is_vllm_compatible():
    req = parse_body(LoadAdapterRequest, {"lora_name": "t1", "lora_path": "/x"})
    assert (req.lora_name, req.lora_path, req.public, req.replace) == ("t1", "/x", None, False)
    with pytest.raises(InvalidRequest, match="lora_path"):
        parse_body(LoadAdapterRequest, {"lora_name": "t1"})


@pytest.mark.parametrize(
    "model, body, where",
    [
        (LoadAdapterRequest, {"lora_name": "t1", "lora_path": "/x", "public": "yes"}, "public"),
        (LoadAdapterRequest, {"lora_name": "t1", "lora_path": "/x", "replace": 1}, "replace"),
        (WarmAdapterRequest, {"lora_name": "t1", "replicas": "2"}, "replicas"),
        (WarmAdapterRequest, {"lora_name": "t1", "replicas": True}, "replicas"),
        (WarmAdapterRequest, {"lora_name": "t1"}, "replicas"),
    ],
)
def test_admin_bodies_are_strict(model, body, where):
    with pytest.raises(InvalidRequest) as e:
        parse_body(model, body)
    assert str(e.value).startswith(f"{where}: ")


@pytest.mark.parametrize("replicas", [0, 1, 100_000])
def test_warm_replicas_are_passed_on_as_given(replicas):
    # the registry owns the range (0 clears the target, as in the CLI)
    req = parse_body(WarmAdapterRequest, {"lora_name": "t1", "replicas": replicas})
    assert req.replicas == replicas
    assert not hasattr(parse_body(AdapterNameRequest, {"lora_name": "t1"}), "replicas")


@pytest.mark.parametrize(
    "message, param",
    [
        ("replicas=-1; allowed: 0 .. 100000", "replicas"),
        ("pool: 'x' is not a pool; allowed: ...", "pool"),
        ("adapter name 'a=b' is invalid; allowed: ...", None),
        ("embedded null byte", None),
    ],
)
def test_a_registry_check_names_the_field_it_names_first(message, param):
    assert param_of_check(message) == param


def _loop_stall(coro) -> tuple[float, object]:
    """(longest the event loop was unavailable while `coro` ran, its result)."""

    async def go():
        done, worst = False, 0.0

        async def ticker():
            nonlocal worst
            last = time.monotonic()
            while not done:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                worst, last = max(worst, now - last), now

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.03)
        result = await coro
        done = True
        await tick
        return worst, result

    return asyncio.run(go())


def test_a_big_body_is_parsed_without_stalling_the_loop():
    # ~1 s of validation on one core: 2M token ids (6 MB)
    body = json.dumps({"model": "m", "prompt": [5] * 2_000_000}).encode()
    assert len(body) > BIG_BODY
    started = time.monotonic()
    worst, req = _loop_stall(parse_request(CompletionRequest, body))
    took = time.monotonic() - started
    assert req.prompt == [5] * 2_000_000
    # on the loop it stalls for all of `took`; off it, for a share of a loaded machine, or
    # for a stall of the whole machine, which lengthens `took` as much
    assert worst < max(0.5, took / 2), f"the event loop stalled {worst:.2f} s of {took:.2f} s"


@pytest.mark.parametrize("size", [10, BIG_BODY + 10])
def test_parse_request_answers_like_parse_body(size):
    body = json.dumps({"model": "m", "prompt": "x" * size, "max_tokens": "2"}).encode()
    with pytest.raises(InvalidRequest) as e:
        asyncio.run(parse_request(CompletionRequest, body))
    assert (str(e.value), e.value.param) == (
        "max_tokens: got a string; allowed: an integer",
        "max_tokens",
    )


@pytest.mark.parametrize(
    "fields, message, param",
    [
        (
            {"max_completion_tokens": 0},
            "max_completion_tokens: got 0; allowed: an integer >= 1",
            "max_completion_tokens",
        ),
        (
            {"messages": [{"role": "wizard", "content": "x"}]},
            'messages.0.role: got "wizard"; allowed: "system", "user", "assistant", '
            '"developer" or "tool"',
            "messages.0.role",
        ),
        (
            {"messages": [{"role": 5, "content": "x"}]},
            'messages.0.role: got 5; allowed: "system", "user", "assistant", "developer" or "tool"',
            "messages.0.role",
        ),
        (
            {"messages": [{"content": "x"}]},
            "messages.0.role: missing; this field is required",
            "messages.0.role",
        ),
        ({"messages": None}, "messages: missing or null; this field is required", "messages"),
        (
            {"messages": []},
            "messages: got an empty list; allowed: a list of at least 1 item",
            "messages",
        ),
        (
            {"model": ""},
            "model: got an empty string; allowed: a string of at least 1 character",
            "model",
        ),
    ],
)
def test_chat_field_errors_say_what_came_and_what_is_allowed(fields, message, param):
    # were pydantic's "Input should be greater than or equal to 1", "Input should be
    # 'system', ...", "Field required", "List should have at least 1 item after
    # validation, not 0", "String should have at least 1 character"
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    with pytest.raises(InvalidRequest) as e:
        parse_body(ChatCompletionRequest, body)
    assert (str(e.value), e.value.param) == (message, param)
