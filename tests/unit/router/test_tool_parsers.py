"""tool_call_parser "llama3_json", "mistral" and "pythonic" (router.tool_parsers), pure
logic: each streams its calls as they are generated, not at the end of the text: a
llama3_json or mistral call's first delta (index, id, name) once its name's string
closes (a mistral named call's once its { or [ARGS] ends the name:
test_tool_mistral.py), then its arguments' JSON text as written, a character at a time
when it comes so; a pythonic call whole once the `,` or `]` after it arrives. Text that turns out no
call streams as content once it is known, and any text (broken formats, cut anywhere)
reads the same every way (hermes' too: it shares the JSON call reader). The helpers here
read a text every way (random pieces, whole, a character at a time) for the per-format
tests (test_tool_llama3_json.py, test_tool_mistral.py, test_tool_pythonic.py)."""

from __future__ import annotations

import random

import pytest

from router.chat_reader import joined
from router.tool_parsers import HermesCalls, Llama3Calls, MistralCalls, PythonicCalls
from tests.unit.router.test_tools import stream_pieces, whole_message, without_ids

NAMES = {"get_weather", "now"}
READERS = {
    "hermes": HermesCalls,
    "llama3_json": Llama3Calls,
    "mistral": MistralCalls,
    "pythonic": PythonicCalls,
}


def reader(parser: str, parallel: bool = True):
    return lambda: READERS[parser](names=NAMES, parallel=parallel)


def read_every_way(make, text: str, seed: int, finish: str = "stop") -> tuple[list[dict], dict]:
    """The deltas of text fed in random pieces and the message they join into, checked
    to equal the whole text's message and the one of text fed a character at a time; each
    call's first delta comes before its arguments' others, indexes counting from 0."""
    deltas, message = stream_pieces(make(), text, seed)
    whole, _ = whole_message(make(), text, finish)
    stream = make()
    by_character = joined([d for ch in text for d in stream.feed(ch)] + stream.end())
    assert without_ids(message) == without_ids(whole) == without_ids(by_character)
    started = 0
    for call in (c for d in deltas for c in d.get("tool_calls", ())):
        if "id" in call:
            assert call["index"] == started and call["type"] == "function"
            started += 1
        else:
            assert set(call) == {"index", "function"} and call["index"] < started
    return deltas, message


def by_character(make, text: str) -> list[tuple[int, dict]]:
    """(where in text, delta) of each delta of text fed a character at a time (the end's
    at len(text))."""
    stream, out = make(), []
    for i, ch in enumerate(text):
        out += [(i, d) for d in stream.feed(ch)]
    return out + [(len(text), d) for d in stream.end()]


ARGUMENTS = '{"city": "Oslo }\\"", "days": [1, {"x": "]"}]}'
ANSWERS = {  # two calls; the first's name, its arguments and the second's name
    "llama3_json": f'{{"name": "get_weather", "parameters": {ARGUMENTS}}}; {{"name": "now"}}',
    "mistral": f'Sure. [TOOL_CALLS][{{"name": "get_weather", "arguments": {ARGUMENTS}}},'
    ' {"name": "now", "arguments": {}}]',
}


@pytest.mark.parametrize("parser", sorted(ANSWERS))
def test_a_json_call_streams_its_name_then_its_arguments_as_they_come(parser):
    text = ANSWERS[parser]
    out = by_character(reader(parser), text)
    sent = [(i, d["tool_calls"][0]) for i, d in out if "tool_calls" in d]
    first_at, first = sent[0]
    assert first_at == text.index('"get_weather"') + len('"get_weather"') - 1  # its quote
    assert first["function"] == {"name": "get_weather", "arguments": ""} and first["index"] == 0
    arguments = [(i, c["function"]["arguments"]) for i, c in sent[1:] if c["index"] == 0]
    # a delta for each character of the arguments, as it arrived
    assert [text[i] for i, _ in arguments] == [piece for _, piece in arguments] == list(ARGUMENTS)
    second_at, second = next((i, c) for i, c in sent if c.get("id") and c["index"] == 1)
    assert second_at == text.index('"now"') + len('"now"') - 1
    assert second["function"]["name"] == "now"


def test_a_pythonic_call_is_sent_once_the_comma_after_it_arrives():
    text = '[get_weather(city="Oslo, )"), now()]'
    sent = [(i, d["tool_calls"][0]) for i, d in by_character(reader("pythonic"), text)]
    assert [(i, c["index"], c["function"]) for i, c in sent] == [
        (text.index("),") + 1, 0, {"name": "get_weather", "arguments": '{"city": "Oslo, )"}'}),
        (len(text) - 1, 1, {"name": "now", "arguments": "{}"}),
    ]


@pytest.mark.parametrize(
    "parser, text, known_at",
    [  # text that turns out no call is content from there on, not held to the end
        ("llama3_json", "{Note: it rains} and more", 1),
        ("llama3_json", '{"name": "rm", "parameters": {}} and more', 31),
        ("pythonic", "[1] Oslo is sunny, you see", 2),
        ("pythonic", "[rm(a=1), now()] and more", 8),
        ("pythonic", "[now(x=1).y, now()] and more", 11),  # at the , after it
        ("mistral", '[TOOL_CALLS][{"name": "rm", "arguments": {}}] and more', 43),
    ],
)
def test_text_that_is_no_call_streams_once_it_is_known(parser, text, known_at):
    out = by_character(reader(parser), text)
    assert all("tool_calls" not in d for _, d in out)
    assert out[0][0] == known_at and "".join(d["content"] for _, d in out) == text
    assert [i for i, _ in out] == list(range(known_at, len(text)))


NOISE = ["{", "}", "[", "]", '"', "\\", ",", ":", ";", " ", "\n", "x", "1", "é", "#", "'", ")", "a=1",
         '"name": ', '"now"', '"rm"', '"arguments": ', '"parameters": ', "now(", "rm(",
         "<|python_tag|>", "<|python_end|>", "[TOOL_CALLS]", "<tool_call>", "</tool_call>",
         "[ARGS]", "[AR", "now{", "no", "[CALL_ID]", "[CALL_", "a1B2c3D4e", '"""', "lambda a, b: 1"]  # fmt: skip
STARTS = ["", "{", "[", '{"name": "now", ', "[now(", "[now(), ", "[TOOL_CALLS][", "<tool_call>",
          "[TOOL_CALLS]now", "[TOOL_CALLS]now[ARGS]", "[TOOL_CALLS]get_weather{",
          "[TOOL_CALLS]now[CALL_ID]", '{"name": "now", "name": ']  # fmt: skip


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("parser", sorted(READERS))
@pytest.mark.parametrize("seed", range(100))
def test_any_text_reads_the_same_every_way(parser, parallel, seed):
    # broken formats, cut anywhere: no reader fails, and every way of feeding agrees
    rng = random.Random(seed)
    text = rng.choice(STARTS) + "".join(rng.choice(NOISE) for _ in range(rng.randint(1, 25)))
    read_every_way(reader(parser, parallel), text, seed)
