"""router.tools, router.tool_calls and router.chat_reader, pure logic: tools and tool_choice
read into a plan, its forcing grammar, the forced calls' readers (fed in random pieces, a
stream, or whole, a response, with the same result) and the choice of a parser's reader.
The "auto" readers are test_tool_hermes.py's and test_tool_parsers.py's."""

from __future__ import annotations

import json
import random

import pytest
import xgrammar as xgr

from lora_core.errors import InvalidRequest
from router.chat_reader import ChatReader, joined
from router.frontend import Frontend
from router.tool_calls import CallArray, NamedCall
from router.tool_parsers import READERS, HermesCalls
from router.tools import (
    NO_PARAMETERS,
    Tool,
    ToolPlan,
    plan_of,
    template_renders_tools,
    tools_of,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "now"}}


def fn(name: str, **function) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


@pytest.mark.parametrize(
    "tools, message",
    [
        ({"a": 1}, "tools: got dict; allowed: a list of at most 128 tools"),
        ([fn("f")] * 129, "tools: got 129 tools; allowed: a list of at most 128"),
        ([{"type": "code_interpreter"}], 'tools[0]: allowed: {"type": "function"'),
        ([fn("a b")], 'tools[0].function.name: got "a b"; allowed: 1 to 64 letters'),
        ([fn("x" * 65)], "tools[0].function.name: got"),
        ([fn("f"), fn("f")], "tools[1].function.name: 'f' is named twice"),
        ([fn("f", parameters=[1])], "tools[0].function.parameters: allowed: a JSON schema"),
        ([fn("f", description=3)], "tools[0].function.description: allowed: a string"),
        ([fn("f", examples=[])], "tools[0]: unknown field 'examples'"),
    ],
)
def test_bad_tools_name_the_field(tools, message):
    with pytest.raises(ValueError) as e:
        tools_of(tools)
    assert str(e.value).startswith(message)


def test_tools_read_with_their_defaults():
    (weather, clock) = tools_of([WEATHER, CLOCK])
    assert weather == Tool(
        "get_weather", WEATHER["function"]["parameters"], "The weather in a city"
    )
    assert clock == Tool("now", NO_PARAMETERS)
    assert clock.template_dict() == {
        "type": "function",
        "function": {"name": "now", "parameters": NO_PARAMETERS},
    }


@pytest.mark.parametrize(
    "tools, choice, want",
    [
        (None, None, "none"),
        ([WEATHER], None, "auto"),  # OpenAI's default once tools are given
        ([WEATHER], "none", "none"),
        (None, "auto", "auto"),
        ([WEATHER], "required", "required"),
        ([WEATHER, CLOCK], {"type": "function", "function": {"name": "now"}}, "function"),
    ],
)
def test_choices(tools, choice, want):
    assert plan_of(tools, choice, None).choice == want


@pytest.mark.parametrize(
    "choice, message",
    [
        ("any", 'tool_choice: got "any"; allowed: "none", "auto", "required"'),
        ({"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name: 'nope'"),
        ({"type": "function"}, "tool_choice: got"),
        ({"type": "function", "function": {"name": "now"}, "x": 1}, "tool_choice: got"),
    ],
)
def test_bad_choices_name_the_field(choice, message):
    with pytest.raises(ValueError) as e:
        plan_of([WEATHER, CLOCK], choice, None)
    assert str(e.value).startswith(message)


def test_required_needs_tools_and_auto_needs_a_parser():
    with pytest.raises(ValueError, match='"required" with no tools'):
        plan_of(None, "required", None)
    with pytest.raises(InvalidRequest, match="cluster arg tool_call_parser"):
        plan_of([WEATHER], "auto", None).check_parser(None)
    plan_of([WEATHER], "auto", None).check_parser("hermes")
    plan_of(None, "auto", None).check_parser(None)  # "auto" without tools: plain text


def test_a_schema_xgrammar_refuses_is_named_by_its_tool():
    bad = fn(
        "f", parameters={"type": "object", "properties": {"a": {"type": "string", "pattern": "a("}}}
    )
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(ValueError, match=r"^tools\[1\]\.function\.parameters: Regex"):
            plan_of([CLOCK, bad], choice, None)
    assert plan_of([CLOCK, bad], "auto", None).grammar() is None  # not forced: not compiled


def _matches(grammar_json: str, text: str) -> bool:
    """Whether text is a whole sentence of the JSON schema's grammar (compact JSON)."""
    compiled = xgr.GrammarCompiler(
        xgr.TokenizerInfo([chr(c) for c in range(32, 127)])
    ).compile_json_schema(grammar_json, any_whitespace=False)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def test_required_grammar_admits_calls_of_the_tools_only():
    plan = plan_of([WEATHER, CLOCK], "required", None)
    schema = plan.grammar().value
    one = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    two = one[:-1] + ', {"name": "now", "parameters": {}}]'
    assert _matches(schema, one) and _matches(schema, two)
    assert not _matches(schema, "[]")  # at least one call
    assert not _matches(schema, '[{"name": "nope", "parameters": {}}]')
    assert not _matches(schema, '[{"name": "get_weather", "parameters": {}}]')  # city required
    single = plan_of([WEATHER, CLOCK], "required", False).grammar().value
    assert _matches(single, one) and not _matches(single, two)


def pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def stream_pieces(stream, text: str, seed: int) -> tuple[list[dict], dict]:
    """The deltas of text fed to stream in random pieces (then its end), and the message
    they join into."""
    deltas = [d for piece in pieces(text, random.Random(seed)) for d in stream.feed(piece)]
    deltas += stream.end()
    return deltas, joined(deltas)


def read_pieces(make, text: str, seed: int) -> tuple[str | None, list[dict]]:
    message = stream_pieces(make(), text, seed)[1]
    return message["content"], message.get("tool_calls", [])


def without_ids(message: dict) -> dict:
    """message with its calls' ids left out (fresh random ones in every reading)."""
    calls = [{k: v for k, v in c.items() if k != "id"} for c in message.get("tool_calls", ())]
    return {**message, "tool_calls": calls} if calls else message


def whole_message(stream, text: str, finish: str | None):
    return ChatReader(tools=stream).whole(text, finish)


def named_calls(calls: list[dict]) -> list[tuple[str, dict]]:
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


ARRAY = '[{"name": "f", "parameters": {"a": "x]}\\"{", "b": [1, {"c": []}]}}, {"name": "g", "parameters": {}}]'


@pytest.mark.parametrize("seed", range(20))
def test_a_call_array_reads_the_same_in_any_pieces(seed):
    content, calls = read_pieces(CallArray, ARRAY, seed)
    assert content is None
    assert named_calls(calls) == [("f", {"a": 'x]}"{', "b": [1, {"c": []}]}), ("g", {})]
    assert len({c["id"] for c in calls}) == 2


def test_a_cut_call_array_keeps_what_did_not_close_as_content():
    cut = ARRAY.removesuffix('ameters": {}}]')
    content, calls = read_pieces(CallArray, cut, 0)
    assert named_calls(calls) == [("f", {"a": 'x]}"{', "b": [1, {"c": []}]})]
    assert content == '{"name": "g", "par'
    message, finish = whole_message(CallArray(), cut, "length")
    assert finish == "length" and message["content"] == content
    assert whole_message(CallArray(), "[", "length")[0] == {"role": "assistant", "content": "["}


@pytest.mark.parametrize("seed", range(5))
def test_an_element_that_is_not_json_is_content_not_an_error(seed):
    # a raw tab in a string: what xgrammar's bounded strings once let through
    bad = '{"name": "f", "parameters": {"a": "x\ty"}}'
    text = "[" + ARRAY[1:-1] + ", " + bad + "]"
    content, calls = read_pieces(CallArray, text, seed)
    assert [name for name, _ in named_calls(calls)] == ["f", "g"]
    assert content == bad
    message, finish = whole_message(CallArray(), "[" + bad + "]", "stop")
    assert message == {"role": "assistant", "content": bad} and finish == "stop"


@pytest.mark.parametrize("seed", range(10))
def test_a_named_call_is_its_arguments(seed):
    content, calls = read_pieces(lambda: NamedCall(name="f"), '{"a": [1, 2]}', seed)
    assert content is None and named_calls(calls) == [("f", {"a": [1, 2]})]
    message, finish = whole_message(NamedCall(name="f"), '{"a": 1}', "stop")
    assert finish == "stop"  # as OpenAI's forced call
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert whole_message(NamedCall(name="f"), "", "length")[0]["tool_calls"][0]["function"] == {
        "name": "f",
        "arguments": "",
    }


def test_finish_reason_says_tool_calls_only_after_a_call():
    message, finish = whole_message(HermesCalls(names={"now"}), "hello", "stop")
    assert message == {"role": "assistant", "content": "hello"} and finish == "stop"
    text = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    assert whole_message(HermesCalls(names={"now"}), text, "stop")[1] == "tool_calls"
    assert whole_message(HermesCalls(names={"now"}), text, "length")[1] == "length"


def test_plain_plans_read_nothing():
    assert plan_of(None, None, None).stream("hermes") is None
    assert plan_of([WEATHER], "none", None).stream("hermes") is None
    assert ToolPlan((), "auto").stream("hermes") is None


def test_a_template_that_never_reads_tools_is_told_apart():
    assert template_renders_tools("{% for t in tools %}{{ t }}{% endfor %}")
    assert template_renders_tools({"default": "{{ messages }}", "tool_use": "{{ tools }}"})
    assert not template_renders_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not template_renders_tools(None)


def test_each_parser_reads_auto_plans_with_its_reader():
    plan = plan_of([WEATHER, CLOCK], "auto", False)
    for parser, reader in READERS.items():
        stream = plan.stream(parser)
        assert type(stream) is reader and stream.names == {"get_weather", "now"}
        assert not stream.parallel
        assert plan.keeps_special_tokens(parser) == (parser == "mistral")  # [TOOL_CALLS]
    assert not plan_of([WEATHER], "required", None).keeps_special_tokens("mistral")
    with pytest.raises(ValueError) as e:
        Frontend(None, None, None, 64, tool_call_parser="qwen")
    assert str(e.value) == (
        "tool_call_parser='qwen'; allowed: None or ('hermes', 'llama3_json', 'mistral', 'pythonic')"
    )
