"""A structural tag asked for on REST (response_format {"type": "structural_tag", ...},
structured_outputs.structural_tag, vLLM's older top-level structural_tag) and gRPC
(GenerateRequest field 39, structured_structural_tag): every form reaches SamplingParams
as the same spec, and a bad one is refused naming the part at fault."""

from __future__ import annotations

import json

import pytest

from lora_core.errors import InvalidRequest
from replica.structural_tag import structural_tag_text
from replica.structured_spec import StructuredOutput
from router.body_parse import parse_body
from router.grpc_service import sampling_of
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from router.proto import lorafleet_pb2 as pb
from router.structured_request import grpc_asks_grammar
from tests.unit.replica.test_structural_tag import TAG
from tests.unit.router.test_structured_request import chat, completion

FORMAT = {  # the same tag in xgrammar's format form
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": TAG["triggers"],
        "tags": [
            {"type": "tag", "begin": s["begin"],
             "content": {"type": "json_schema", "json_schema": s["schema"]}, "end": s["end"]}
            for s in TAG["structures"]
        ],
    },
}  # fmt: skip
WANT = StructuredOutput("structural_tag", structural_tag_text(TAG, "f"))
BAD = {**TAG, "triggers": ["<tool="]}
BAD_BEGIN = 'structures[0].begin: "<function=get_weather>" starts with 0 of the triggers'


def test_both_forms_are_the_same_spec():
    assert StructuredOutput("structural_tag", structural_tag_text(FORMAT, "f")) == WANT


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": TAG},
        {"response_format": FORMAT},
        {"structured_outputs": {"structural_tag": json.dumps(TAG), "backend": "xgrammar"}},
        {"structured_outputs": {"structural_tag": json.dumps(FORMAT), "disable_any_whitespace": True}},
        {"structured_outputs": {"structural_tag": TAG}},
        {"structural_tag": json.dumps(TAG)},
    ],
)  # fmt: skip
@pytest.mark.parametrize("wrap", [completion, chat])
def test_each_form_reaches_sampling_params(fields, wrap):
    model = CompletionRequest if wrap is completion else ChatCompletionRequest
    req = parse_body(model, wrap(**fields))
    params = req.to_sampling_params() if wrap is completion else req.to_sampling_params(16)
    assert req.structured == WANT and params.structured_outputs == WANT


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"response_format": BAD}, f"response_format.{BAD_BEGIN}"),
        ({"response_format": {**FORMAT, "format": {"type": "nope"}}},
         "response_format.format: Invalid structural tag error: Format type not recognized"),
        ({"structured_outputs": {"structural_tag": json.dumps(BAD)}}, f"structured_outputs.structural_tag.{BAD_BEGIN}"),
        ({"structured_outputs": {"structural_tag": "{"}}, "structured_outputs.structural_tag: not valid JSON"),
        ({"structured_outputs": {"structural_tag": json.dumps(TAG), "disable_any_whitespace": False}},
         "structured_outputs.disable_any_whitespace: false applies to json and json_object only; "
         "allowed with structural_tag: true or null"),
        ({"structural_tag": json.dumps(BAD)}, f"structural_tag.{BAD_BEGIN}"),
        ({"response_format": TAG, "guided_regex": "a"}, "guided_regex: given with response_format; allowed: one"),
        ({"response_format": {"type": "xml"}},
         'response_format: got {"type": "xml"}; allowed: {"type": "text"}, {"type": "json_object"}, '
         '{"type": "json_schema", "json_schema": {...}} or {"type": "structural_tag", ...}'),
    ],
)  # fmt: skip
def test_rest_refusals_name_the_field(fields, message):
    with pytest.raises(InvalidRequest) as e:
        parse_body(CompletionRequest, completion(**fields))
    assert str(e.value).startswith(message), str(e.value)
    assert e.value.param == message.split(":")[0].split(".")[0]


def test_a_forced_tool_call_with_a_structural_tag_is_refused():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = chat(response_format=TAG, tools=[tool], tool_choice="required")
    with pytest.raises(InvalidRequest) as e:
        parse_body(ChatCompletionRequest, body)
    assert "given with a structured output (response_format, structured_outputs, guided_* or " \
        "structural_tag)" in str(e.value)  # fmt: skip


def _grpc(**fields) -> pb.GenerateRequest:
    req = pb.GenerateRequest(model="m", prompt="x", **fields)
    return pb.GenerateRequest.FromString(req.SerializeToString())  # as it comes off the wire


def test_grpc_field_39_is_an_optional_string_of_either_form():
    field = pb.GenerateRequest.DESCRIPTOR.fields_by_name["structured_structural_tag"]
    assert (field.number, field.type, field.has_presence) == (39, field.TYPE_STRING, True)
    for tag in (TAG, FORMAT):
        req = _grpc(structured_structural_tag=json.dumps(tag))
        assert grpc_asks_grammar(req) and sampling_of(req).structured_outputs == WANT
    assert not grpc_asks_grammar(_grpc()) and sampling_of(_grpc()).structured_outputs is None


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"structured_structural_tag": json.dumps(BAD)}, f"structured_structural_tag.{BAD_BEGIN}"),
        ({"structured_structural_tag": ""}, "structured_structural_tag: 0 characters of JSON; allowed: 1 to"),
        ({"structured_structural_tag": "[]"}, "structured_structural_tag: got list; allowed: "),
        ({"structured_structural_tag": json.dumps(TAG), "structured_regex": "a"},
         "structured_structural_tag: given with structured_regex; allowed: one structured_* field"),
        ({"structured_structural_tag": json.dumps(TAG), "structured_any_whitespace": True},
         "structured_any_whitespace: given with structured_structural_tag; allowed: true only with"),
    ],
)  # fmt: skip
def test_grpc_refusals_name_the_field(fields, message):
    req = _grpc(**fields)
    assert grpc_asks_grammar(req)
    with pytest.raises(InvalidRequest) as e:
        sampling_of(req)
    assert str(e.value).startswith(message), str(e.value)
