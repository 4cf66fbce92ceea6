"""Stop strings are bounded (count and length) with one message on REST and gRPC.

Every engine step checks each stop string against the text's tail under the engine lock;
before the bound, one request with 1000 stop strings of 2000 characters (a 2 MB body)
added 0.3 s to every step of every request on its replica.
"""

import pytest

from lora_core.errors import InvalidRequest
from replica.sampling_checks import MAX_STOP_CHARS, MAX_STOPS
from router.body_parse import parse_body
from router.grpc_service import sampling_of
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from router.proto import lorafleet_pb2 as pb

ALLOWED = (
    "allowed: a non-empty string or a list of at most 16 non-empty strings, each of at "
    "most 256 characters"
)
CHAT = [{"role": "user", "content": "hi"}]


def rest_params(stop):
    completion = parse_body(CompletionRequest, {"model": "m", "prompt": "x", "stop": stop})
    chat = parse_body(ChatCompletionRequest, {"model": "m", "messages": CHAT, "stop": stop})
    return completion.to_sampling_params(), chat.to_sampling_params(10)


def refusals(stop) -> list[tuple[str, str | None]]:
    """(message, param) from completions, chat and gRPC for the same stop list."""
    out = []
    for make in (
        lambda: rest_params(stop)[0],
        lambda: rest_params(stop)[1],
        lambda: sampling_of(pb.GenerateRequest(stop=[stop] if isinstance(stop, str) else stop)),
    ):
        with pytest.raises(InvalidRequest) as e:
            make()
        out.append((str(e.value), e.value.param))
    return out


def test_the_bounds_are_what_the_message_says():
    assert (MAX_STOPS, MAX_STOP_CHARS) == (16, 256)


@pytest.mark.parametrize(
    "stop",
    [
        ["s" * MAX_STOP_CHARS] * MAX_STOPS,
        "x" * MAX_STOP_CHARS,
        [f"stop{i}" for i in range(MAX_STOPS)],
    ],
)
def test_stops_up_to_the_bounds_are_kept(stop):
    expected = (stop,) if isinstance(stop, str) else tuple(stop)
    for params in rest_params(stop):
        assert params.stop == expected
    grpc_stop = [stop] if isinstance(stop, str) else stop
    assert sampling_of(pb.GenerateRequest(stop=grpc_stop)).stop == expected


@pytest.mark.parametrize(
    "stop, message",
    [
        ([f"s{i}" for i in range(MAX_STOPS + 1)], f"stop: 17 strings; {ALLOWED}"),
        (["ok", "y" * (MAX_STOP_CHARS + 1)], f"stop: a string of 257 characters; {ALLOWED}"),
        ("z" * 2000, f"stop: a string of 2000 characters; {ALLOWED}"),
        (["ok", ""], f"stop: {ALLOWED}"),
    ],
)
def test_stops_past_the_bounds_are_refused_alike_everywhere(stop, message):
    assert refusals(stop) == [(message, "stop")] * 3
