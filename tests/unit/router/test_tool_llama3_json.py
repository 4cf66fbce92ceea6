"""tool_call_parser "llama3_json" (router.tool_parsers.llama3_json), pure logic: its
answers read the same in any pieces (and whole, and a character at a time); each call's
arguments are the JSON text as written; an answer whose first object is no call of the
request's tools is content as it came; once a call was sent, what breaks the answer is
content from where the last call's text ended. Fresh random answers read as written."""

from __future__ import annotations

import json
import random

import pytest

from tests.unit.router.test_tool_hermes import random_object, repeated_members, written_json
from tests.unit.router.test_tool_parsers import NAMES, read_every_way, reader

NOW = '{"name": "now", "parameters": {}}'


def _calls(message: dict) -> list[tuple[str, str]]:
    for c in message.get("tool_calls", ()):
        assert c["id"].startswith("call_")
    return [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", ())
    ]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "text, content, calls",
    [
        (NOW, None, [("now", "{}")]),
        (
            '\n<|python_tag|>{"name": "get_weather", "parameters": {"city": "a;b"}}; '
            '{"name": "now", "arguments": {}}',
            None,
            [("get_weather", '{"city": "a;b"}'), ("now", "{}")],
        ),
        ('<|python_tag|> ;\n{"name": "now"};;\n', None, [("now", "{}")]),  # no arguments: {}
        (f"{NOW}{NOW}", None, [("now", "{}"), ("now", "{}")]),  # no separator is one too
        ('\u00a0{"name": "now", "parameters": "{\\"a\\": 1}"}', None, [("now", '{"a": 1}')]),
        (  # arguments before the name: read whole at the object's end
            '{"parameters": {"city": "x"}, "name": "get_weather"}',
            None,
            [("get_weather", '{"city": "x"}')],
        ),
        ('{"name": "now", "parameters": {"a": tru}}', None, [("now", '{"a": tru}')]),  # as written
        ("It is sunny {today}.", "It is sunny {today}.", []),  # text: not a call answer
        ('{"name": "rm", "parameters": {}}', '{"name": "rm", "parameters": {}}', []),
        ('{"name": 3}; ' + NOW, '{"name": 3}; ' + NOW, []),
        ("{Note: it rains}", "{Note: it rains}", []),
        ('{"name": "no', '{"name": "no', []),  # cut before its name closed
        ("  <|python", "  <|python", []),
        (" <|python_tag|>\n", " <|python_tag|>\n", []),
        # a call is sent once its name is read: what breaks the answer after it is content
        (NOW + " and more", " and more", [("now", "{}")]),
        (NOW + '; {"name": "rm", "parameters": {}}', '; {"name": "rm", "parameters": {}}', [("now", "{}")]),
        (NOW + "; {oops}", "; {oops}", [("now", "{}")]),
        ('{"name": "now", "param', ', "param', [("now", "")]),  # cut by max_tokens
        ('{"name": "now", "parameters": {"a": [1', None, [("now", '{"a": [1')]),
        ('{"name": "now", "parameters": {}, "x', ', "x', [("now", "{}")]),
        ('{"name": "now", oops}; ' + NOW, ", oops}; " + NOW, [("now", "")]),
        ('{"name": "now", "parameters": 7}', ', "parameters": 7}', [("now", "")]),
        ('{"name": "now", "parameters": {}]; ' + NOW, "]; " + NOW, [("now", "{}")]),
        # of repeated members the first is the call's, streamed or read whole alike
        ('{"name": "now", "name": "rm", "parameters": {"a": 1}, "parameters": {"b": 2}}', None, [("now", '{"a": 1}')]),
        ('{"parameters": {"a": 1}, "name": "now", "parameters": {"b": 2}}', None, [("now", '{"a": 1}')]),
        ('{"parameters": {"a": 1}, "arguments": {"b": 2}, "name": "now"}', None, [("now", '{"a": 1}')]),
        ('{"name": "now", "arguments": "{\\"a\\": 1}", "parameters": {"b": 2}}', None, [("now", '{"a": 1}')]),
        ('{"name": "now", "arguments": 7, "parameters": {}}', ', "arguments": 7, "parameters": {}}', [("now", "")]),
        ('{"name": "rm", "name": "now"}', '{"name": "rm", "name": "now"}', []),
        ('{"arguments": {}, "name": "rm", "name": "now"}', '{"arguments": {}, "name": "rm", "name": "now"}', []),
    ],
)  # fmt: skip
def test_llama3_json_answers_read_the_same_in_any_pieces(text, content, calls, seed):
    message = read_every_way(reader("llama3_json"), text, seed)[1]
    assert message["content"] == content and _calls(message) == calls


def test_llama3_json_without_parallel_calls_keeps_the_second_as_content():
    text = f"{NOW}; {NOW}"
    message = read_every_way(reader("llama3_json", parallel=False), text, 0)[1]
    assert _calls(message) == [("now", "{}")] and message["content"] == f"; {NOW}"


def _random_answer(rng: random.Random, parallel: bool) -> tuple[str, str | None, list]:
    """A random answer: (text, the content it must read into, its calls' (name, arguments
    text)): objects that are calls, and ones that are no call (an unknown name, no JSON,
    a second call without parallel), arguments before the name, members repeated; text
    after them."""
    text = rng.choice(["", " ", "\n", "<|python_tag|>", " <|python_tag|>\n"])
    calls: list[tuple[str, str]] = []
    frontier, broken = 0, False
    for k in range(rng.randint(1, 4)):
        kinds = ["call", "call", "call", "unknown", "no json", "arguments first", "repeats"]
        kind = rng.choice(kinds)
        name, arguments = rng.choice(sorted(NAMES)), random_object(rng)
        written, key = written_json(rng, arguments), rng.choice(["parameters", "arguments"])
        sp = rng.choice(["", " ", "\n"])
        item = f'{{"name":{sp}"{name}",{sp}"{key}": {written}{sp}}}'
        if kind == "unknown":
            item = item.replace(f'"{name}"', '"rm"', 1)
        elif kind == "no json":
            item = "{oops: " + written + "}"
        elif kind == "arguments first":
            item, written = f'{{"{key}": {written}, "name": "{name}"}}', json.dumps(arguments)
        elif kind == "repeats":
            item, written = repeated_members(rng, name, arguments)
        text += rng.choice([";", "; ", "\n;\n", " ", ""]) if k else ""
        text += item
        if broken:
            continue
        if kind in ("unknown", "no json") or (calls and not parallel):
            broken = True
            continue
        if kind == "arguments first":  # read whole: as `router.tool_calls.call_of` writes them
            written = json.dumps(arguments, ensure_ascii=False)
        calls.append((name, written))
        frontier = len(text)
    tail = rng.choice(["", ";", "\n", " and more"])
    text += tail
    if not broken and not tail.strip(" \n;"):
        return text, None, calls
    return text, text[frontier:] if calls else text, calls


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("seed", range(150))
def test_random_llama3_json_answers_stream_as_they_read_whole(seed, parallel):
    rng = random.Random(seed)
    text, content, calls = _random_answer(rng, parallel)
    message = read_every_way(reader("llama3_json", parallel), text, seed)[1]
    assert _calls(message) == calls
    assert message["content"] == content
