"""Long answers (several `Text` blocks: router.tool_calls.Text) read by every tool call
reader, streamed (a character at a time, in random pieces) and whole alike: the readers
keep the text they grew in a `Text`, read each new piece as a str, and reach back (for a
call read whole, or text that turns out no call) across blocks; and `Text` reads as the
str it holds."""

from __future__ import annotations

import json
import random

import pytest

from router.tool_calls import BLOCK, CallArray, Text
from tests.unit.router.test_tool_parsers import read_every_way, reader

WORDS = ["Oslo ", "é", "中文", "🙂", "\\", '"', "'", "]", "}", "{", "[", "(", ")", ",", "#",
         "\n", ";", "</tool_call>", "[TOOL_CALLS]", "<|python_end|>", '"""']  # fmt: skip
LONG = "".join(random.Random(7).choices(WORDS, k=3 * BLOCK))
"""A string of about 9 blocks, quotes, brackets and the formats' markers in it."""


def _object(name: str, key: str = "arguments", first: str = "name") -> str:
    members = {"name": name, key: {"text": LONG, "n": [1, {"m": "]"}]}}
    if first != "name":
        members = dict(reversed(members.items()))
    return json.dumps(members, ensure_ascii=False)


CALL, UNKNOWN = _object("get_weather"), _object("rm")
PY_LONG = repr(LONG)
CASES = {
    "hermes": [
        LONG + "<tool_call>" + CALL + "</tool_call>" + LONG,
        "<tool_call>" + _object("get_weather", first="arguments") + "</tool_call>",
        "<tool_call>" + UNKNOWN + "</tool_call><tool_call>" + CALL + "</tool_call>",
        "<tool_call>" + CALL[: 5 * BLOCK],  # a call the end cut
    ],
    "llama3_json": [
        " \n" * BLOCK + _object("get_weather", "parameters") + '; {"name": "now"}',
        _object("get_weather", "parameters", first="parameters"),
        '{"name": "now"}; ' + _object("rm", "parameters"),  # breaks after a call
        _object("get_weather", "parameters") + " and then " + LONG,
        _object("rm", "parameters"),  # no call: all of it content
    ],
    "mistral": [
        LONG + "[TOOL_CALLS][" + CALL + ", " + UNKNOWN + "]" + LONG,
        "[TOOL_CALLS]" + " " * 3 * BLOCK + "[" + CALL + "]",
        "[TOOL_CALLS]get_weather" + json.dumps({"text": LONG}) + "[TOOL_CALLS]now{}",
        "[TOOL_CALLS]get_weather[ARGS]" + json.dumps({"text": LONG})[: 4 * BLOCK],
    ],
    "pythonic": [
        f"[get_weather(city={PY_LONG}, days=[1, 2]), now()]",
        "<|python_start|>" + "\n" * 3 * BLOCK + f"[get_weather(city={PY_LONG})]<|python_end|>",
        f'[now(), get_weather(city="""{LONG.replace(chr(92), "")}"""), rm(x={PY_LONG})]',
        f"[now(), rm(x={PY_LONG})] and then " + LONG,
        f"[get_weather(city={PY_LONG})" + LONG,  # a list the end cut
    ],
}


@pytest.mark.parametrize(
    ("parser", "case"), [(p, i) for p, texts in sorted(CASES.items()) for i in range(len(texts))]
)
@pytest.mark.parametrize("seed", range(2))
def test_a_long_answer_reads_the_same_streamed_and_whole(parser, case, seed):
    read_every_way(reader(parser), CASES[parser][case], seed)


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_a_long_call_streams_its_arguments_as_written(parser):
    text = CASES[parser][0]
    _, message = read_every_way(reader(parser), text, 0)
    call = message["tool_calls"][0]["function"]
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"text": LONG, "n": [1, {"m": "]"}]}


OUTSIDE = LONG.replace("</tool_call>", "")
HELD = {  # text a reader holds until it knows what it is, and the content it turns out
    "hermes": ("<tool_call>" + CALL + OUTSIDE + "</tool_call>", OUTSIDE + "</tool_call>"),
    "mistral": ("[TOOL_CALLS]" + "\n " * 2 * BLOCK, "[TOOL_CALLS]" + "\n " * 2 * BLOCK),
}


@pytest.mark.parametrize("parser", sorted(HELD))
def test_long_held_text_ends_as_content(parser):
    """Hermes' text after a call in its block, mistral's whitespace after a [TOOL_CALLS]
    the end cut before its form was known: several blocks held, then content."""
    text, want = HELD[parser]
    _, message = read_every_way(reader(parser), text, 0)
    assert message["content"] == want


def test_a_long_pythonic_call_reads_whole():
    _, message = read_every_way(reader("pythonic"), CASES["pythonic"][0], 0)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert calls == [("get_weather", json.dumps({"city": LONG, "days": [1, 2]}, ensure_ascii=False)),
                     ("now", "{}")]  # fmt: skip


def test_a_long_call_array_reads_the_same_in_any_pieces():
    text = json.dumps([{"name": "f", "parameters": {"text": LONG}}] * 2, ensure_ascii=False)
    cut = json.dumps(LONG, ensure_ascii=False)[:BLOCK]
    text = text[:-1] + ', {"name": "g", "parameters": {"text": ' + cut
    want = CallArray()
    want_deltas = want.feed(text) + want.end()
    for pieces in ([text], list(text), [text[i : i + 7] for i in range(0, len(text), 7)]):
        stream = CallArray()
        deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.end()
        assert _without_ids(deltas) == _without_ids(want_deltas)
    assert [d["content"] for d in want_deltas if "content" in d] == [
        text[text.rindex('{"name": "g"') :]
    ]
    assert [d["tool_calls"][0]["function"]["name"] for d in want_deltas if "tool_calls" in d] == [
        "f",
        "f",
    ]


def _without_ids(deltas: list[dict]) -> list[dict]:
    """deltas with their calls' ids left out (fresh random ones in every reading)."""
    return [
        {"tool_calls": [{k: v for k, v in c.items() if k != "id"} for c in d["tool_calls"]]}
        if "tool_calls" in d
        else d
        for d in deltas
    ]


@pytest.mark.parametrize("seed", range(5))
def test_text_reads_as_the_str_it_holds(seed):
    rng = random.Random(seed)
    want = rng.choice(["", "ab", LONG])
    text = Text(want)
    for _ in range(300):
        piece = rng.choice(
            ["", "x", "é中", "🙂" * rng.randint(1, 40), LONG[: rng.randint(0, 3 * BLOCK)]]
        )
        text += piece
        want += piece
        assert len(text) == len(want) and str(text) == want
        for _ in range(5):
            a, b = (
                rng.randint(-len(want) - 3, len(want) + 3),
                rng.randint(-len(want) - 3, len(want) + 3),
            )
            assert text[a:b] == want[a:b] and text[a:] == want[a:] and text[:b] == want[:b]
            assert text.startswith(want[max(a, 0) : max(a, 0) + 3], max(a, 0))
            if -len(want) <= a < len(want):
                assert text[a] == want[a]
            else:
                with pytest.raises(IndexError):
                    text[a]
