"""tool_call_parser "llama3_json", "mistral" and "pythonic" (router.tool_parsers), pure
logic: each format's cases, fed in random pieces (a stream) with the result of the
whole text; fresh random calls read back as written; what is no call of the request's
tools (an unknown name, a second call without parallel_tool_calls, a cut answer, text)
stays content as it came."""

from __future__ import annotations

import json
import random
import re

import pytest

from router.tool_parsers import Llama3Calls, MistralCalls, PythonicCalls
from router.tool_parsers.pythonic import pythonic_calls
from tests.unit.router.test_tool_hermes import random_object, random_value
from tests.unit.router.test_tools import (
    named_calls,
    read_pieces,
    stream_pieces,
    whole_message,
    without_ids,
)

NAMES = {"get_weather", "now"}


def _llama3(parallel: bool = True):
    return lambda: Llama3Calls(names=NAMES, parallel=parallel)


def _mistral(parallel: bool = True):
    return lambda: MistralCalls(names=NAMES, parallel=parallel)


def _pythonic(parallel: bool = True):
    return lambda: PythonicCalls(names=NAMES, parallel=parallel)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('{"name": "now", "parameters": {}}', None, [("now", {})]),
        (
            '\n<|python_tag|>{"name": "get_weather", "parameters": {"city": "a;b"}}; '
            '{"name": "now", "arguments": {}}',
            None,
            [("get_weather", {"city": "a;b"}), ("now", {})],
        ),
        ("It is sunny {today}.", "It is sunny {today}.", []),  # text: not a call answer
        ('{"name": "rm", "parameters": {}}', '{"name": "rm", "parameters": {}}', []),
        (
            '{"name": "now", "parameters": {}} and more',
            '{"name": "now", "parameters": {}} and more',
            [],
        ),
        ('{"name": "now", "param', '{"name": "now", "param', []),  # cut by max_tokens
        ("  <|python", "  <|python", []),
    ],
)
def test_llama3_json_answers_read_the_same_in_any_pieces(text, content, calls, seed):
    got_content, got_calls = read_pieces(_llama3(), text, seed)
    assert got_content == content and named_calls(got_calls) == calls


def test_llama3_json_without_parallel_calls_keeps_two_as_content():
    text = '{"name": "now", "parameters": {}}; {"name": "now", "parameters": {}}'
    assert read_pieces(_llama3(parallel=False), text, 0) == (text, [])


def _mistral_calls(calls: list[dict]) -> list[tuple[str, dict]]:
    """(name, arguments) of Mistral calls, whose ids are 9 letters and digits each."""
    assert all(re.fullmatch("[A-Za-z0-9]{9}", c["id"]) for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


NOW = '{"name": "now", "arguments": {}}'


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("no calls [at] all", "no calls [at] all", []),
        (
            f'Sure. [TOOL_CALLS] [{NOW}, {{"name": "get_weather", "arguments": {{"city": "a]}}"}}}}]',
            "Sure. ",
            [("now", {}), ("get_weather", {"city": "a]}"})],
        ),
        (f"[TOOL_CALLS][{NOW}]\n", None, [("now", {})]),
        ('[TOOL_CALLS][{"name": "now", "arguments": "{\\"a\\": 1}"}]', None, [("now", {"a": 1})]),
        (  # after the array: text again, and another array
            f'[TOOL_CALLS][{NOW}] then [TOOL_CALLS][{{"name": "now", "parameters": {{"x": 1}}}}]',
            " then ",
            [("now", {}), ("now", {"x": 1})],
        ),
        ('[TOOL_CALLS][{"name": "rm", "arguments": {}}]', '[TOOL_CALLS][{"name": "rm", "arguments": {}}]', []),
        (
            f'[TOOL_CALLS][{NOW}, {{"name": "rm", "arguments": {{}}}}, {NOW}]',  # rm: the rest
            f', {{"name": "rm", "arguments": {{}}}}, {NOW}]',
            [("now", {})],
        ),
        (f'[TOOL_CALLS][{NOW}, {{"name": "get_we', ', {"name": "get_we', [("now", {})]),  # cut
        (f"[TOOL_CALLS][{NOW}, 3]", ", 3]", [("now", {})]),
        ('[TOOL_CALLS][{"name": "now", "arguments": {}]', '[TOOL_CALLS][{"name": "now", "arguments": {}]', []),
        ("[TOOL_CALLS] hello", "[TOOL_CALLS] hello", []),
        ("[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
        (f"[TOOL_CALLS]{NOW}", f"[TOOL_CALLS]{NOW}", []),  # an object, no array
        ("a [TOOL_", "a [TOOL_", []),  # held while it may begin the marker, then text
    ],
)  # fmt: skip
def test_mistral_calls_read_the_same_in_any_pieces(text, content, calls, seed):
    got_content, got_calls = read_pieces(_mistral(), text, seed)
    assert got_content == content and _mistral_calls(got_calls) == calls
    whole, finish = whole_message(_mistral()(), text, "stop")
    assert whole["content"] == content and finish == ("tool_calls" if calls else "stop")


def test_mistral_without_parallel_calls_keeps_the_second_as_content():
    text = f"[TOOL_CALLS][{NOW}, {NOW}]"
    content, calls = read_pieces(_mistral(parallel=False), text, 0)
    assert _mistral_calls(calls) == [("now", {})] and content == f", {NOW}]"


def _prose(rng: random.Random, bits: list[str], marker: str) -> str:
    text = "".join(rng.choice(bits) for _ in range(rng.randint(0, 6)))
    return text.replace(marker, "")


@pytest.mark.parametrize("seed", range(100))
def test_random_mistral_answers_stream_as_they_read_whole(seed):
    rng = random.Random(seed)
    text, content, calls = "", "", []
    bits = ["[", "]", "[TOOL_", "CALLS]", "{", "x", " ", "\n", "é", '"']
    for _ in range(rng.randint(1, 3)):
        prose = _prose(rng, bits, "[TOOL_CALLS]")
        if (text + prose).count("[TOOL_CALLS]") > text.count("[TOOL_CALLS]"):
            prose = " " + prose
        elements = [
            (rng.choice(sorted(NAMES)), random_object(rng)) for _ in range(rng.randint(1, 3))
        ]
        sep = rng.choice([", ", ",", ",\n"])
        array = sep.join(
            json.dumps({"name": n, "arguments": a}, ensure_ascii=rng.random() < 0.5)
            for n, a in elements
        )
        text += f"{prose}[TOOL_CALLS]{rng.choice(['', ' '])}[{array}]"
        content += prose
        calls += [(n, json.dumps(a, ensure_ascii=False)) for n, a in elements]
    deltas, message = stream_pieces(_mistral()(), text, seed)
    assert without_ids(message) == without_ids(whole_message(_mistral()(), text, "stop")[0])
    assert [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
    ] == calls
    assert message["content"] == (content if content.strip() else None)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "text, calls",
    [
        ('[get_weather(city="oslo", days=3), now()]', [("get_weather", {"city": "oslo", "days": 3}), ("now", {})]),
        ("<|python_start|>[now()]<|python_end|>", [("now", {})]),  # Llama 4's, kept in the text
        (
            "  [now(a={'b': [1, -2.5e3, None, True]}, c=(1, 2), d='\\n\"')]\n",
            [("now", {"a": {"b": [1, -2500.0, None, True]}, "c": [1, 2], "d": '\n"'})],
        ),
    ],
)  # fmt: skip
def test_pythonic_calls_read_the_same_in_any_pieces(text, calls, seed):
    content, got = read_pieces(_pythonic(), text, seed)
    assert content is None and named_calls(got) == calls


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "text",
    [
        "It is sunny [today].",
        "[1] Oslo is sunny",
        "[now(1)]",  # positional arguments: not a call of keywords
        "[now(**kw)]",
        "[now(x=y)]",  # a name, not a literal: never evaluated
        '[now(x=open("f"))]',
        "[now(x={1, 2})]",  # a set: no JSON
        "[now(x=b'a')]",
        "[now(x=1e999)]",  # infinite: no JSON
        '[os.system(cmd="ls")]',
        "[rm()]",  # not one of the tools
        "[now(x=1)] and more",
        "[now(x=1), 3]",
        "[now(",  # cut by max_tokens
        "[]",
        "<|python_st",
    ],
)
def test_pythonic_answers_that_are_no_calls_stay_content(text, seed):
    assert read_pieces(_pythonic(), text, seed) == (text, [])


def test_pythonic_without_parallel_calls_keeps_two_as_content():
    text = "[now(), now()]"
    assert read_pieces(_pythonic(parallel=False), text, 0) == (text, [])
    assert pythonic_calls("[f(a=1, b=[True, None])]") == [("f", '{"a": 1, "b": [true, null]}')]


@pytest.mark.parametrize("seed", range(100))
def test_random_pythonic_calls_read_back_as_written(seed):
    rng = random.Random(seed)
    calls = [
        (rng.choice(sorted(NAMES)), {f"a{i}": random_value(rng) for i in range(rng.randint(0, 3))})
        for _ in range(rng.randint(1, 3))
    ]
    sp = rng.choice(["", " ", "\n"])
    written = [f"{n}({f',{sp}'.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls]
    text = f"{sp}[{f',{sp}'.join(written)}]"
    deltas, message = stream_pieces(_pythonic()(), text, seed)
    assert without_ids(message) == without_ids(whole_message(_pythonic()(), text, "stop")[0])
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert got == [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]
