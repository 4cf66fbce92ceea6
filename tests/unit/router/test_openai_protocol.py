import pytest

from lora_core.errors import InvalidRequest
from replica.sampling_params import SamplingParams
from router.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadAdapterRequest,
    parse_body,
)


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
        ({"model": "a", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "a", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "a", "prompt": "x", "temperature": 2.5}, "temperature"),
        ({"model": "a", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "a", "prompt": "x", "n": 2}, "n"),
        (
            {"model": "a", "prompt": "x", "logprobs": 21},
            "logprobs: Value error, 21 is out of range; allowed: 0 to 20",
        ),
        (
            {"model": "a", "prompt": "x", "logprobs": -1},
            "logprobs: Value error, -1 is out of range; allowed: 0 to 20",
        ),
        ({"model": "a", "prompt": "x", "echo": True}, "echo"),
        ({"model": "a", "prompt": "x", "seed": "s"}, "seed"),
        ({"model": "a", "prompt": "x", "stop": [1]}, "stop"),
    ],
)
def test_completion_rejects_bad_input_naming_the_field(body, where):
    with pytest.raises(InvalidRequest) as e:
        parse_body(CompletionRequest, body)
    assert where in str(e.value)


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
        {"role": "user", "content": "hello"},
    ]
    assert req.to_sampling_params().max_tokens == 9
    assert req.to_sampling_params().logprobs
    assert req.include_usage


@pytest.mark.parametrize(
    "body, where",
    [
        ({"model": "a", "messages": []}, "messages"),
        ({"model": "a", "messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"model": "a", "messages": [{"role": "user"}]}, "content"),
        (
            {"model": "a", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 21},
            "top_logprobs: Value error, 21 is out of range; allowed: 0 to 20",
        ),
    ],
)
def test_chat_rejects_bad_input(body, where):
    with pytest.raises(InvalidRequest) as e:
        parse_body(ChatCompletionRequest, body)
    assert where in str(e.value)


@pytest.mark.parametrize("k", [0, 1, 20])
def test_top_logprobs_map_to_sampling_params(k):
    msgs = [{"role": "user", "content": "x"}]
    chat = parse_body(
        ChatCompletionRequest,
        {"model": "a", "messages": msgs, "logprobs": True, "top_logprobs": k},
    )
    assert (chat.to_sampling_params().logprobs, chat.to_sampling_params().top_logprobs) == (True, k)
    comp = parse_body(CompletionRequest, {"model": "a", "prompt": "x", "logprobs": k})
    assert (comp.to_sampling_params().logprobs, comp.to_sampling_params().top_logprobs) == (True, k)


def test_chat_top_logprobs_need_logprobs():
    body = {"model": "a", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    req = parse_body(ChatCompletionRequest, body)
    with pytest.raises(InvalidRequest, match="top_logprobs=2 needs logprobs"):
        req.to_sampling_params()


def test_load_adapter_body_is_vllm_compatible():
    req = parse_body(LoadAdapterRequest, {"lora_name": "t1", "lora_path": "/x"})
    assert (req.lora_name, req.lora_path, req.public, req.replace) == ("t1", "/x", False, False)
    with pytest.raises(InvalidRequest, match="lora_path"):
        parse_body(LoadAdapterRequest, {"lora_name": "t1"})
