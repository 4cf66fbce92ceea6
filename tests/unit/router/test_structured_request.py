"""router.structured_request: response_format, structured_outputs and guided_* read into
one StructuredOutput (parsed, so a bad spec is a 400 naming its field), and gRPC's fields."""

from __future__ import annotations

import json
import time

import pytest

from lora_core.errors import InvalidRequest
from replica.structured_spec import (
    FREE_WHITESPACE,
    MAX_CHOICES,
    MAX_SPEC_DEPTH,
    StructuredOutput,
    choice_ebnf,
)
from router.body_parse import parse_body
from router.grpc_service import sampling_of
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from router.proto import lorafleet_pb2 as pb

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def completion(**fields):
    return {"model": "m", "prompt": "hi", **fields}


def chat(**fields):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize(
    "fields, want",
    [
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
            StructuredOutput("json", json.dumps(SCHEMA)),
        ),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutput("json", json.dumps(SCHEMA))),
        ({"structured_outputs": {"regex": "[a-z]+", "backend": "xgrammar"}}, StructuredOutput("regex", "[a-z]+")),
        ({"structured_outputs": {"choice": ["a", "b"], "disable_any_whitespace": True}}, StructuredOutput("choice", ("a", "b"))),
        ({"structured_outputs": {"grammar": 'root ::= "x"'}}, StructuredOutput("grammar", 'root ::= "x"')),
        ({"structured_outputs": {"json_object": True, "regex": None}}, StructuredOutput("json_object")),
        ({"structured_outputs": {"json_object": True, "disable_any_whitespace": False}},
         StructuredOutput("json_object", whitespace=FREE_WHITESPACE)),
        ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": False}},
         StructuredOutput("json", json.dumps(SCHEMA), FREE_WHITESPACE)),
        ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": None}},
         StructuredOutput("json", json.dumps(SCHEMA))),
        ({"guided_json": SCHEMA, "guided_decoding_backend": "auto"}, StructuredOutput("json", json.dumps(SCHEMA))),
        ({"guided_regex": "a|b"}, StructuredOutput("regex", "a|b")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutput("choice", ("yes", "no"))),
        ({"guided_grammar": 'root ::= "y"'}, StructuredOutput("grammar", 'root ::= "y"')),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {}, "guided_json": None, "structured_outputs": None}, None),
    ],
)  # fmt: skip
@pytest.mark.parametrize("wrap", [completion, chat])
def test_each_form_reaches_sampling_params(fields, want, wrap):
    model = CompletionRequest if wrap is completion else ChatCompletionRequest
    req = parse_body(model, wrap(**fields))
    assert req.structured == want
    params = req.to_sampling_params() if wrap is completion else req.to_sampling_params(16)
    assert params.structured_outputs == want


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"response_format": {"type": "xml"}}, 'response_format: got {"type": "xml"}; allowed: '),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema: allowed: an object with \"schema\""),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}},
         'response_format.json_schema: Unsupported type "bogus"'),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
         "response_format.json_schema: unknown field 'x'"),
        ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex: Regex parsing error at position "),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs: 2 of json, regex"),
        ({"structured_outputs": {}}, "structured_outputs: 0 of json, regex"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern: not supported"),
        ({"structured_outputs": {"regex": "a", "disable_any_whitespace": False}},
         "structured_outputs.disable_any_whitespace: false applies to json and json_object only; allowed with regex: true or null"),
        ({"structured_outputs": {"grammar": 'root ::= "x"', "disable_any_whitespace": False}},
         "structured_outputs.disable_any_whitespace: false applies to json and json_object only; allowed with grammar: true or null"),
        ({"structured_outputs": {"regex": "a", "backend": "outlines"}}, 'structured_outputs.backend: got "outlines"'),
        ({"structured_outputs": "a"}, "structured_outputs: got str; allowed: an object"),
        ({"guided_json": "{not json"}, "guided_json: not valid JSON"),
        ({"guided_json": [1]}, "guided_json: got list; allowed: a JSON schema object"),
        ({"guided_choice": "a"}, "guided_choice: allowed: a list of strings"),
        ({"guided_choice": []}, f"guided_choice: 0 choices; allowed: 1 to {MAX_CHOICES} strings"),
        ({"guided_choice": ["a"] * (MAX_CHOICES + 1)}, f"guided_choice: {MAX_CHOICES + 1} choices"),
        ({"guided_regex": 5}, "guided_regex: got int; allowed: a string"),
        ({"guided_regex": ""}, "guided_regex: 0 characters; allowed: 1 to 65536"),
        ({"guided_grammar": "root ::= "}, "guided_grammar: EBNF parser error"),
        ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend: got"),
        ({"guided_json": SCHEMA, "guided_whitespace_pattern": "[\n ]*"},
         "guided_whitespace_pattern: not supported (xgrammar takes no whitespace pattern, and a pattern "
         "such as [\\n ]* would let a model loop on newlines); allowed: null, or structured_outputs with "
         f"disable_any_whitespace false for JSON with at most {FREE_WHITESPACE} whitespace characters"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice: given with guided_regex; allowed: one"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex: given with response_format;"),
    ],
)  # fmt: skip
def test_bad_specs_are_refused_naming_the_field(fields, message):
    with pytest.raises(InvalidRequest) as e:
        parse_body(CompletionRequest, completion(**fields))
    assert str(e.value).startswith(message), str(e.value)
    assert e.value.param == message.split(":")[0].split(".")[0]


def test_choice_strings_are_escaped_for_the_grammar():
    choices = ('say "hi"', "back\\slash", "caf\u00e9", "\U0001f600", "tab\there")
    assert choice_ebnf(choices[:2]) == 'root ::= "say \\"hi\\"" | "back\\\\slash"'
    StructuredOutput("choice", choices).grammar()  # parses


def test_grpc_fields():
    def params(**fields):
        return sampling_of(pb.GenerateRequest(model="m", prompt="x", **fields))

    assert params().structured_outputs is None
    assert params(structured_choice=["a", "b"]).structured_outputs == StructuredOutput(
        "choice", ("a", "b")
    )
    assert params(structured_json_object=True).structured_outputs == StructuredOutput("json_object")
    got = params(structured_json_schema=json.dumps(SCHEMA)).structured_outputs
    assert got == StructuredOutput("json", json.dumps(SCHEMA))
    for fields, message in [
        ({"structured_regex": "a("}, "structured_regex: Regex parsing error"),
        (
            {"structured_regex": "a", "structured_grammar": 'root ::= "a"'},
            "structured_grammar: given with structured_regex",
        ),
        ({"structured_json_schema": "[1]"}, "structured_json_schema: got list"),
        (
            {"structured_any_whitespace": True},
            "structured_any_whitespace: given alone; allowed: true only with "
            "structured_json_schema or structured_json_object",
        ),
        (
            {"structured_regex": "a", "structured_any_whitespace": True},
            "structured_any_whitespace: given with structured_regex; allowed: true only with",
        ),
    ]:
        with pytest.raises(InvalidRequest) as e:
            params(**fields)
        assert str(e.value).startswith(message) and e.value.param == message.split(":")[0]


def test_grpc_any_whitespace_is_field_30_and_asks_free_whitespace():
    field = pb.GenerateRequest.DESCRIPTOR.fields_by_name["structured_any_whitespace"]
    assert field.number == 30 and field.type == field.TYPE_BOOL
    for fields, want in [
        ({"structured_json_object": True}, StructuredOutput("json_object", whitespace=FREE_WHITESPACE)),
        ({"structured_json_schema": json.dumps(SCHEMA)},
         StructuredOutput("json", json.dumps(SCHEMA), FREE_WHITESPACE)),
    ]:  # fmt: skip
        req = pb.GenerateRequest(model="m", prompt="x", structured_any_whitespace=True, **fields)
        wire = pb.GenerateRequest.FromString(req.SerializeToString())
        assert wire.structured_any_whitespace and sampling_of(wire).structured_outputs == want
        wire.structured_any_whitespace = False
        assert sampling_of(wire).structured_outputs == StructuredOutput(want.kind, want.value)


def _nested(depth: int) -> str:
    """A schema `depth` levels of objects deep: arrays of arrays of ... integers."""
    arrays = depth - 1
    return '{"type": "array", "items": ' * arrays + '{"type": "integer"}' + "}" * arrays


@pytest.mark.parametrize("depth", [MAX_SPEC_DEPTH + 1, MAX_SPEC_DEPTH + 2, 900, 2000])
@pytest.mark.parametrize(
    "fields",
    [
        lambda text: {"guided_json": text},
        lambda text: {"structured_outputs": {"json": text}},
        lambda text: {"grpc": {"structured_json_schema": text}},
        lambda text: {
            "grpc": {
                "structured_structural_tag": json.dumps(
                    {
                        "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}],
                        "triggers": ["<f>"],
                    }
                ).replace("{}", text)
            }
        },
    ],
)
def test_schema_text_nested_too_deep_is_refused_before_compiling(fields, depth):
    """A schema sent as text nests at most MAX_SPEC_DEPTH levels, as one inside a REST body:
    xgrammar's compile time grows with the cube of the depth (900 levels: 44 s of CPU on
    the ingress), and past Python's recursion limit json.loads raised a RecursionError (a
    500). Both are a 400 now, answered in milliseconds."""
    text = _nested(depth)
    assert json.loads(text) if depth < 1000 else True
    given = fields(text)
    start = time.perf_counter()
    with pytest.raises(InvalidRequest) as e:
        if "grpc" in given:
            sampling_of(pb.GenerateRequest(model="m", prompt="x", **given["grpc"]))
        else:
            parse_body(CompletionRequest, completion(**given)).to_sampling_params()
    assert time.perf_counter() - start < 5
    assert f"nested more than {MAX_SPEC_DEPTH} levels" in str(e.value), str(e.value)
    assert e.value.param == next(iter(given.get("grpc", given)))


def test_schema_text_at_the_depth_limit_is_taken():
    text = _nested(MAX_SPEC_DEPTH)
    got = sampling_of(pb.GenerateRequest(model="m", prompt="x", structured_json_schema=text))
    assert json.loads(got.structured_outputs.value) == json.loads(text)
