"""gRPC request -> SamplingParams: float32 fields read as REST's decimals would be."""

import pytest

from lora_core.errors import InvalidRequest
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
    ],
)
def test_grpc_messages_match_rest(fields, message):
    with pytest.raises(InvalidRequest) as e:
        sampling_of(pb.GenerateRequest(max_tokens=2, **fields))
    assert (str(e.value), e.value.param) == (message, next(iter(fields)))


def test_sampling_of_keeps_the_values():
    params = sampling_of(pb.GenerateRequest(temperature=0.7, top_p=0.9))
    assert (params.temperature, params.top_p, params.max_tokens) == (0.7, 0.9, 16)
