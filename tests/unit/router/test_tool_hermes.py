"""tool_call_parser "hermes" (router.tool_parsers.hermes), pure logic: each call streams as
it is generated (its first delta once the name is read, then its arguments' text), and on
fresh random texts in random pieces: the whole message equals the stream's deltas
joined, each call's arguments are exactly the JSON text the model wrote, and every block
that is no call stays content as it came. A call already sent whose block then breaks
keeps what follows as content, or its arguments as written."""

from __future__ import annotations

import json
import random

import pytest

from router.chat_reader import joined
from router.tool_parsers import HermesCalls
from tests.unit.router.test_tools import (
    named_calls,
    read_pieces,
    stream_pieces,
    whole_message,
    without_ids,
)

NAMES = {"get_weather", "now"}
HERMES = (
    "Let me check. <tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Oslo <tool_call>"}}\n</tool_call>'
    '<tool_call>{"name": "now", "arguments": {}}</tool_call> and <tool_'
)


DEEP = '<tool_call>{"arguments": ' + "[" * 5000 + "]" * 5000 + ', "name": "now"}</tool_call>'


def _hermes(parallel: bool = True):
    return lambda: HermesCalls(names=NAMES, parallel=parallel)


@pytest.mark.parametrize("seed", range(20))
def test_hermes_calls_read_the_same_in_any_pieces(seed):
    content, calls = read_pieces(_hermes(), HERMES, seed)
    assert content == "Let me check.  and <tool_"
    assert named_calls(calls) == [("get_weather", {"city": "Oslo <tool_call>"}), ("now", {})]


def test_a_call_streams_its_name_then_its_arguments_as_they_come():
    arguments = '{"city": "Oslo }\\"", "days": [1, {"x": "</tool_call"}]}'
    text = f'<tool_call>{{"name": "get_weather", "arguments": {arguments}}}</tool_call>'
    stream, sent = _hermes()(), []
    named = text.index('"get_weather"') + len('"get_weather"')
    for i, ch in enumerate(text):
        for delta in stream.feed(ch):
            sent.append((i, delta["tool_calls"][0]))
    first_at, first = sent[0]
    assert first_at == named - 1  # the name's closing quote
    assert first["function"] == {"name": "get_weather", "arguments": ""} and first["index"] == 0
    assert all(set(d) == {"index", "function"} and d["index"] == 0 for _, d in sent[1:])
    streamed = "".join(d["function"]["arguments"] for _, d in sent[1:])
    assert streamed == arguments
    # every character went out once nothing that follows could make it a tag's
    closed = text.index(arguments) + len(arguments)
    assert "".join(d["function"]["arguments"] for i, d in sent[1:] if i < closed) == arguments
    assert stream.end() == []


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("no calls at all", "no calls at all", []),
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        (
            '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',  # not one of the tools
            '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
            [],
        ),
        ('<tool_call>{"name": "now", "arguments": {}}', None, [("now", {})]),  # cut by EOS
        ('<tool_call>{"name": "now", "arguments": "{}"}</tool_call>', None, [("now", {})]),
        ('<tool_call>{"name": "now"}</tool_call>', None, [("now", {})]),
        ('<tool_call>{"name": "now", "arguments": {}, "id": [1]}</tool_call>', None, [("now", {})]),
        (  # arguments before the name: read whole at the block's end
            '<tool_call>{"arguments": {"city": "x"}, "name": "get_weather"}</tool_call>',
            None,
            [("get_weather", {"city": "x"})],
        ),
        (
            '<tool_call>{"arguments": {"city": "x"}, "name": "get_weather"',  # cut: as it came
            '<tool_call>{"arguments": {"city": "x"}, "name": "get_weather"',
            [],
        ),
        ('<tool_call>{"name": "no', '<tool_call>{"name": "no', []),  # cut before its name
        ('<tool_call>{"name": 3, "arguments": {}}', '<tool_call>{"name": 3, "arguments": {}}', []),
        (DEEP, DEEP, []),  # deeper than json decodes: no call, as it came
        (  # a </tool_call> quoted in a string is text; a broken block ends at the first
            '<tool_call>{"name": "now", "arguments": {"q": "a </tool_call> b"}}</tool_call>'
            '<tool_call>oops "x</tool_call> <tool_call>{"name": "now", "arguments": {}}</tool_call>',
            '<tool_call>oops "x</tool_call> ',
            [("now", {"q": "a </tool_call> b"}), ("now", {})],
        ),
        (  # an unknown tool's block, read whole, keeps its quoted tag too
            '<tool_call>{"name": "rm", "arguments": {"q": "</tool_call>"}}</tool_call>!',
            '<tool_call>{"name": "rm", "arguments": {"q": "</tool_call>"}}</tool_call>!',
            [],
        ),
    ],
)
@pytest.mark.parametrize("seed", range(4))
def test_hermes_blocks_that_are_no_call_stay_content(text, content, calls, seed):
    got_content, got_calls = read_pieces(_hermes(), text, seed)
    assert got_content == content and named_calls(got_calls) == calls


@pytest.mark.parametrize(
    "text, content, arguments",
    [  # (d): the call was sent once its name was read; what its block holds is kept
        ('<tool_call>{"name": "now", "arguments": {"a": [1, "x', None, '{"a": [1, "x'),
        ('<tool_call>{"name": "now", "arguments": {"a": 1</tool_call> ok', " ok", '{"a": 1'),
        ('<tool_call>{"name": "now", "arguments": {"a": tru}}</tool_call>', None, '{"a": tru}'),
        ('<tool_call>{"name": "now", "arguments": {}</tool_call>', None, "{}"),  # no last }
        ('<tool_call>{"name": "now", "arguments": {}} so</tool_call>', " so</tool_call>", "{}"),
        ('<tool_call>{"name": "now", "arguments": {}}}</tool_call>', "}</tool_call>", "{}"),
        ('<tool_call>{"name": "now", "arguments": {}}\nI will wait', "\nI will wait", "{}"),
        ('<tool_call>{"name": "now", oops}</tool_call>', ", oops}</tool_call>", ""),
        ('<tool_call>{"name": "now", "arguments": 7}', ', "arguments": 7}', ""),
        ('<tool_call>{"name": "now"', None, ""),
    ],
)
@pytest.mark.parametrize("seed", range(4))
def test_a_sent_call_whose_block_breaks_keeps_the_rest(text, content, arguments, seed):
    got_content, calls = read_pieces(_hermes(), text, seed)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("now", arguments)
    ]
    message, finish = whole_message(_hermes()(), text, "length")
    assert finish == "length" and message["tool_calls"][0]["function"]["arguments"] == arguments


def test_hermes_without_parallel_calls_keeps_the_second_as_content():
    content, calls = read_pieces(_hermes(parallel=False), HERMES, 3)
    assert named_calls(calls) == [("get_weather", {"city": "Oslo <tool_call>"})]
    assert '<tool_call>{"name": "now", "arguments": {}}</tool_call>' in content


STRING_BITS = ['"', "\\", "{", "}", "[", "]", ",", ":", "<tool_call>", "</tool_call", "</", "é", "\n", "x", " "]  # fmt: skip


def random_value(rng: random.Random, depth: int = 0):
    """A random JSON value, its strings made of what readers must escape or skip."""
    kind = rng.choice(["str", "int", "float", "lit", "list", "dict"] if depth < 3 else ["str"])
    if kind == "str":
        return "".join(rng.choice(STRING_BITS) for _ in range(rng.randint(0, 6)))
    if kind == "int":
        return rng.randint(-(10**6), 10**6)
    if kind == "float":
        return rng.uniform(-1e3, 1e3)
    if kind == "lit":
        return rng.choice([True, False, None])
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return random_object(rng, depth + 1)


def random_object(rng: random.Random, depth: int = 0) -> dict:
    """A random JSON object (`random_value`'s), keys with such bits too."""
    return {
        f"k{i}{rng.choice(STRING_BITS)}": random_value(rng, depth) for i in range(rng.randint(0, 3))
    }


def written_json(rng: random.Random, value) -> str:
    """value as a model may write it: compact, spaced or indented, escaped or not."""
    layout = rng.choice([{}, {"separators": (",", ":")}, {"indent": rng.choice([1, 2])}])
    return json.dumps(value, ensure_ascii=rng.random() < 0.5, **layout)


def repeated_members(rng: random.Random, name: str, arguments: dict) -> tuple[str, str]:
    """A call object of name and arguments whose members repeat: later "name",
    "arguments" and "parameters" members (other names, other values) after the first of
    each, which are the call's. (Its text, the arguments text its call must have.) Its
    first arguments come after the name (streamed as written) or before it (read whole),
    as an object or as the JSON text of one (a string)."""
    written = written_json(rng, arguments)
    if rng.random() < 0.3:
        written = json.dumps(written)  # arguments given as a JSON string
    expected = json.loads(written) if written.startswith('"') else written
    members = [f'"name": "{name}"', f'"{rng.choice(["arguments", "parameters"])}": {written}']
    if rng.random() < 0.5:  # arguments first: the object is read whole at its end
        members.reverse()
        if not written.startswith('"'):
            expected = json.dumps(arguments, ensure_ascii=False)
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(["name", "arguments", "parameters"])
        if key == "name":
            value = f'"{rng.choice(["rm", "now", "get_weather"])}"'
        else:
            value = rng.choice([json.dumps(random_object(rng)), "7", '"{}"'])
        first = next(i for i, m in enumerate(members) if m.startswith('"name"') == (key == "name"))
        members.insert(rng.randint(first + 1, len(members)), f'"{key}": {value}')
    return "{" + ", ".join(members) + "}", expected


def _random_text(rng: random.Random, parallel: bool) -> tuple[str, str, list[tuple[str, str]]]:
    """A random answer: (text, the content it must read into, its calls' (name, arguments
    text)): prose, calls of the tools, blocks that are no call (an unknown name, no JSON,
    a second call without parallel, arguments before the name), calls whose members
    repeat."""
    text, content, calls = "", "", []
    for _ in range(rng.randint(1, 5)):
        kinds = ["prose", "call", "call", "unknown", "no json", "arguments first", "repeats"]
        kind = rng.choice(kinds)
        if kind == "prose":
            piece = "".join(
                rng.choice(STRING_BITS[1:] + ["<tool_", "call>", "ok "]) for _ in range(5)
            )
            piece = piece.replace("<tool_call>", "<tool_cal>")
            if (text + piece).count("<tool_call>") > text.count("<tool_call>"):
                piece = " " + piece  # it would end a tag that text began
            text, content = text + piece, content + piece
            continue
        name, arguments = rng.choice(sorted(NAMES)), random_object(rng)
        written = written_json(rng, arguments)
        while "</tool_call>" in written:
            written = written_json(rng, arguments := random_object(rng))
        sp = rng.choice(["", " ", "\n"])
        body = f'{sp}{{"name": "{name}",{sp}"arguments": {written}}}{sp}'
        if kind == "unknown":
            body = body.replace(f'"{name}"', '"rm"', 1)
        elif kind == "no json":
            body = f"{sp}not json {written}"
        elif kind == "arguments first":
            body = f'{{"arguments": {written}, "name": "{name}"}}'
        elif kind == "repeats":
            body, written = repeated_members(rng, name, arguments)
        block = f"<tool_call>{body}</tool_call>"
        text += block
        if kind in ("unknown", "no json") or (calls and not parallel):
            content += block
        elif kind == "arguments first":
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
        else:
            calls.append((name, written))
    return text, content, calls


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("seed", range(200))
def test_random_answers_stream_as_they_read_whole(seed, parallel):
    rng = random.Random(seed)
    text, content, calls = _random_text(rng, parallel)
    deltas, message = stream_pieces(_hermes(parallel)(), text, seed)
    whole, _ = whole_message(_hermes(parallel)(), text, "stop")
    stream = _hermes(parallel)()
    by_character = joined([d for ch in text for d in stream.feed(ch)] + stream.end())
    assert without_ids(message) == without_ids(whole) == without_ids(by_character)  # (a)
    got = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", ())
    ]
    assert got == calls  # (b): the arguments as written; (c) no block is lost
    assert message["content"] == (None if calls and not content.strip() else content)
    assert all(json.loads(arguments) is not None for _, arguments in got)  # the model's was JSON
    firsts = [c for d in deltas for c in d.get("tool_calls", ()) if "id" in c]
    assert [c["index"] for c in firsts] == list(range(len(calls)))
