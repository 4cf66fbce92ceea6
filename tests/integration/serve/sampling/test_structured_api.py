"""Structured outputs end to end: OpenAI's response_format (json_schema, json_object),
vLLM's structured_outputs and guided_* on REST completions and chat, streamed or not, with
n choices, and gRPC's structured_* fields (structured_any_whitespace too). Each answer
equals what an offline engine with the same StructuredOutput generates, and a finished one
matches its spec; a bad spec is a 400 / INVALID_ARGUMENT naming its field.

One app with one replica, shared with this package's other modules (conftest.py).
"""

from __future__ import annotations

import json
import re

import grpc
import httpx
import pytest

from replica.sampling_params import SamplingParams
from replica.structured_spec import FREE_WHITESPACE, StructuredOutput
from router.proto import lorafleet_pb2 as pb
from tests.integration.serve.cluster_fixture import offline_outputs
from tests.integration.serve.sampling.test_sampling_api import PROMPT, create
from tests.unit.replica.test_structured_vs_hf import SCHEMA

pytestmark = pytest.mark.integration
MAX = 40
REGEX = r"(yes|no), [a-z]{2,6}"


def _offline(cluster, spec: StructuredOutput, **fields) -> str:
    params = SamplingParams(max_tokens=MAX, temperature=0.0, structured_outputs=spec, **fields)
    return offline_outputs(cluster, PROMPT, params, ["demo-poet"])["demo-poet"][0]


def test_response_format_json_schema_equals_offline_and_parses(cluster):
    spec = StructuredOutput("json", json.dumps(SCHEMA))
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}}
    r = create(cluster, "completions", max_tokens=MAX, temperature=0,
               extra_body={"response_format": fmt})  # fmt: skip
    assert r.choices[0].text == _offline(cluster, spec)
    if r.choices[0].finish_reason == "stop":
        got = json.loads(r.choices[0].text)
        assert (
            got["color"] in ("red", "green") and 0 <= got["n"] <= 9 and set(got) == {"color", "n"}
        )
    chat = create(cluster, "chat", max_tokens=MAX, temperature=0, response_format=fmt)
    text = chat.choices[0].message.content
    if chat.choices[0].finish_reason == "stop":
        assert json.loads(text)["color"] in ("red", "green")


def test_guided_choice_and_regex_on_chat_streamed_with_n(cluster):
    choices = ["alpha", "beta", "gamma delta"]
    r = create(cluster, "chat", max_tokens=MAX, temperature=1.0, seed=3, n=3,
               extra_body={"guided_choice": choices})  # fmt: skip
    assert {c.message.content for c in r.choices} <= set(choices)
    assert all(c.finish_reason == "stop" for c in r.choices)
    stream = create(cluster, "completions", max_tokens=MAX, temperature=0, stream=True,
                    extra_body={"structured_outputs": {"regex": REGEX}})  # fmt: skip
    chunks = [c.choices[0] for c in stream if c.choices]
    text = "".join(c.text for c in chunks)
    assert text == _offline(cluster, StructuredOutput("regex", REGEX))
    assert chunks[-1].finish_reason == "stop" and re.fullmatch(REGEX, text), text


def test_json_object_top_logprobs_never_offer_a_forbidden_token(cluster):
    r = create(cluster, "completions", max_tokens=3, temperature=0, logprobs=5,
               extra_body={"response_format": {"type": "json_object"}})  # fmt: skip
    lp = r.choices[0].logprobs
    assert lp.tokens[0] == "{"  # a JSON object starts with its brace
    # a first token not starting the object is forbidden: -inf, sent as vLLM's -9999
    first = lp.top_logprobs[0]
    assert all(v == -9999.0 or t.startswith("{") for t, v in first.items()), first
    assert -9999.0 in first.values()


def test_grpc_structured_fields_equal_rest(cluster):
    stub, meta = cluster.grpc_stub(), cluster.grpc_auth()
    req = pb.GenerateRequest(model="demo-poet", prompt=PROMPT, max_tokens=MAX, temperature=0.0,
                             structured_regex=REGEX)  # fmt: skip
    text = "".join(c.text for c in stub.Generate(req, metadata=meta))
    assert text == _offline(cluster, StructuredOutput("regex", REGEX))
    bad = pb.GenerateRequest(model="demo-poet", prompt=PROMPT, structured_regex="a(")
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(bad, metadata=meta))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("structured_regex: Regex parsing error")


def test_grpc_any_whitespace_equals_offline_and_needs_a_json_field(cluster):
    stub, meta = cluster.grpc_stub(), cluster.grpc_auth()
    req = pb.GenerateRequest(model="demo-poet", prompt=PROMPT, max_tokens=MAX, temperature=0.0,
                             structured_json_schema=json.dumps(SCHEMA),
                             structured_any_whitespace=True)  # fmt: skip
    text = "".join(c.text for c in stub.Generate(req, metadata=meta))
    spec = StructuredOutput("json", json.dumps(SCHEMA), FREE_WHITESPACE)
    assert text == _offline(cluster, spec)
    alone = pb.GenerateRequest(model="demo-poet", prompt=PROMPT, structured_any_whitespace=True)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(alone, metadata=meta))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(
        "structured_any_whitespace: given alone; allowed: true only"
    )


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"guided_regex": "a("}, "guided_regex"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}}, "response_format"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a"}, "min_tokens": 2}, "min_tokens"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
def test_bad_specs_are_400_naming_the_field(cluster, fields, param, stream):
    body = {"model": "demo-poet", "prompt": PROMPT, "max_tokens": 4, "stream": stream, **fields}
    r = httpx.post(f"{cluster.http}/v1/completions", json=body,
                   headers={"Authorization": f"Bearer {cluster.keys['ops']}"}, timeout=30)  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
