"""tool_call_parser "mistral" (router.tool_parsers.mistral), pure logic: text, then
[TOOL_CALLS] arrays whose elements stream as calls, read the same in any pieces (and
whole, and a character at a time); ids are 9 letters and digits; an element that is no
call of the request's tools (or a second without parallel_tool_calls) is content from
where the last call's text ended, and the rest is read as text. Fresh random answers
read as written."""

from __future__ import annotations

import json
import random
import re

import pytest

from router.chat_reader import joined
from tests.unit.router.test_tool_hermes import random_object, repeated_members
from tests.unit.router.test_tool_parsers import NAMES, by_character, read_every_way, reader
from tests.unit.router.test_tools import stream_pieces

NOW = '{"name": "now", "arguments": {}}'


def _calls(message: dict) -> list[tuple[str, str]]:
    """(name, arguments) of Mistral calls, whose ids are 9 letters and digits each."""
    calls = message.get("tool_calls", [])
    assert all(re.fullmatch("[A-Za-z0-9]{9}", c["id"]) for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("no calls [at] all", "no calls [at] all", []),
        (
            f'Sure. [TOOL_CALLS] [{NOW}, {{"name": "get_weather", "arguments": {{"city": "a]}}"}}}}]',
            "Sure. ",
            [("now", "{}"), ("get_weather", '{"city": "a]}"}')],
        ),
        (f"[TOOL_CALLS][{NOW}]\n", None, [("now", "{}")]),
        ('[TOOL_CALLS][{"name": "now", "arguments": "{\\"a\\": 1}"}]', None, [("now", '{"a": 1}')]),
        (  # after the array: text again, and another array
            f'[TOOL_CALLS][{NOW}] then [TOOL_CALLS][{{"name": "now", "parameters": {{"x": 1}}}}]',
            " then ",
            [("now", "{}"), ("now", '{"x": 1}')],
        ),
        ('[TOOL_CALLS][{"name": "rm", "arguments": {}}]', '[TOOL_CALLS][{"name": "rm", "arguments": {}}]', []),
        (
            f'[TOOL_CALLS][{NOW}, {{"name": "rm", "arguments": {{}}}}, {NOW}]',  # rm: the rest
            f', {{"name": "rm", "arguments": {{}}}}, {NOW}]',
            [("now", "{}")],
        ),
        (f'[TOOL_CALLS][{NOW}, {{"name": "get_we', ', {"name": "get_we', [("now", "{}")]),  # cut
        (f"[TOOL_CALLS][{NOW}, 3]", ", 3]", [("now", "{}")]),
        ("[TOOL_CALLS] hello", "[TOOL_CALLS] hello", []),
        ("[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
        (f"[TOOL_CALLS]{NOW}", f"[TOOL_CALLS]{NOW}", []),  # an object, no array
        ('[TOOL_CALLS][{"name" 3}] x', '[TOOL_CALLS][{"name" 3}] x', []),
        ("a [TOOL_", "a [TOOL_", []),  # held while it may begin the marker, then text
        # a call is sent once its name is read: what breaks its element after it is content
        ('[TOOL_CALLS][{"name": "now", "arguments": {}]', "]", [("now", "{}")]),
        ('[TOOL_CALLS][{"name": "now", "arguments": {"a": [1', None, [("now", '{"a": [1')]),
        ('[TOOL_CALLS][{"name": "now", oops}] ok', ", oops}] ok", [("now", "")]),
        (f'[TOOL_CALLS][{{"name": "now", "arguments": 7}}, {NOW}]', f', "arguments": 7}}, {NOW}]', [("now", "")]),
        (f'[TOOL_CALLS][{{"name": "now", "arguments": {{}}, "x": 1}}, {NOW}]', None, [("now", "{}")] * 2),
        # the named form (v11+): [TOOL_CALLS]name{...} or name[ARGS]{...}, one marker a call
        ('hi{hi[TOOL_CALLS]now{"a": "}[TOOL_CALLS]"}', "hi{hi", [("now", '{"a": "}[TOOL_CALLS]"}')]),
        ('[TOOL_CALLS]now[ARGS]{"a": 1}', None, [("now", '{"a": 1}')]),
        ('[TOOL_CALLS] now[ARGS]\n {}\n', None, [("now", "{}")]),  # whitespace is neither
        (
            '[TOOL_CALLS]get_weather{"city": "a"}[TOOL_CALLS]now[ARGS]{} ok [TOOL_CALLS]now{}',
            " ok ",
            [("get_weather", '{"city": "a"}'), ("now", "{}"), ("now", "{}")],
        ),
        (f"[TOOL_CALLS]now{{}}[TOOL_CALLS][{NOW}]", None, [("now", "{}")] * 2),  # forms mixed
        # no name of a tool: content from the marker to where that is known, the rest text
        ('[TOOL_CALLS]rm{"a": 1}[TOOL_CALLS]now{}', '[TOOL_CALLS]rm{"a": 1}', [("now", "{}")]),
        ("[TOOL_CALLS]no{}", "[TOOL_CALLS]no{}", []),  # a prefix of "now"
        ("[TOOL_CALLS]nowx{}", "[TOOL_CALLS]nowx{}", []),
        ("[TOOL_CALLS]now {}", "[TOOL_CALLS]now {}", []),
        ("[TOOL_CALLS]now[ARX]{} [TOOL_CALLS]now{}", "[TOOL_CALLS]now[ARX]{} ", [("now", "{}")]),
        ("[TOOL_CALLS]now[TOOL_CALLS]now{}", "[TOOL_CALLS]now", [("now", "{}")]),
        ("[TOOL_CALLS]now[AR", "[TOOL_CALLS]now[AR", []),  # the end cut the marker
        ("[TOOL_CALLS]now[CALL_", "[TOOL_CALLS]now[CALL_", []),
        ("[TOOL_CALLS] \n", "[TOOL_CALLS] \n", []),
        # the end right after a call's name, id or [ARGS]: a call with arguments {}
        ("[TOOL_CALLS]now", None, [("now", "{}")]),
        ("ok [TOOL_CALLS] get_weather", "ok ", [("get_weather", "{}")]),
        ("[TOOL_CALLS]now[ARGS] \n", None, [("now", "{}")]),
        ("[TOOL_CALLS]now[CALL_ID]a1B2c3D4e", None, [("now", "{}")]),
        ("[TOOL_CALLS]now[CALL_ID]", None, [("now", "{}")]),
        ('[TOOL_CALLS]now{"a": 1}[TOOL_CALLS]get_weather', None, [("now", '{"a": 1}'), ("get_weather", "{}")]),
        ("[TOOL_CALLS]rm", "[TOOL_CALLS]rm", []),
        ("[TOOL_CALLS]no", "[TOOL_CALLS]no", []),  # a prefix of "now": no name yet
        ("[TOOL_CALLS]now ", "[TOOL_CALLS]now ", []),
        # [CALL_ID]: the call's id between its name and [ARGS]
        ('[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "a"}', None, [("get_weather", '{"city": "a"}')]),
        ("[TOOL_CALLS]now[CALL_ID]x[ARGS] {}[TOOL_CALLS]now[CALL_ID][ARGS]{}", None, [("now", "{}")] * 2),
        ("[TOOL_CALLS]now[CALL_ID]a1-B2[ARGS]{} x", "[TOOL_CALLS]now[CALL_ID]a1-B2[ARGS]{} x", []),
        ("[TOOL_CALLS]now[CALL_ID]a1B2c3D4e{} x", "[TOOL_CALLS]now[CALL_ID]a1B2c3D4e{} x", []),
        ("[TOOL_CALLS]now[CALL_ID]a[CALL_ID]b[ARGS]{}", "[TOOL_CALLS]now[CALL_ID]a[CALL_ID]b[ARGS]{}", []),
        ("[TOOL_CALLS]now[CALL_ID]a[AR[TOOL_CALLS]now{}", "[TOOL_CALLS]now[CALL_ID]a[AR", [("now", "{}")]),
        ("[TOOL_CALLS]rm[CALL_ID]a1B2c3D4e[ARGS]{}", "[TOOL_CALLS]rm[CALL_ID]a1B2c3D4e[ARGS]{}", []),
        # once sent, a call stays: what breaks it after is content, cut arguments as written
        ('[TOOL_CALLS]now[ARGS] "a" x', ' "a" x', [("now", "")]),
        ('[TOOL_CALLS]now{"a": [1', None, [("now", '{"a": [1')]),
        ('[TOOL_CALLS]now{"a": 1]] x', "] x", [("now", '{"a": 1]')]),  # broken JSON: as written
    ],
)  # fmt: skip
def test_mistral_calls_read_the_same_in_any_pieces(text, content, calls, seed):
    message = read_every_way(reader("mistral"), text, seed)[1]
    assert message["content"] == content and _calls(message) == calls


@pytest.mark.parametrize(
    "text, content",
    [
        (f"[TOOL_CALLS][{NOW}, {NOW}]", f", {NOW}]"),
        ('[TOOL_CALLS]now{}[TOOL_CALLS]now[ARGS]{"a": 1}', '[TOOL_CALLS]now[ARGS]{"a": 1}'),
        (f"[TOOL_CALLS]now{{}}[TOOL_CALLS][{NOW}]", f"[TOOL_CALLS][{NOW}]"),
        ("[TOOL_CALLS]now{}[TOOL_CALLS]now", "[TOOL_CALLS]now"),
        ("[TOOL_CALLS]now{}[TOOL_CALLS]now[CALL_ID]a1B2c3D4e", "[TOOL_CALLS]now[CALL_ID]a1B2c3D4e"),
    ],
)
def test_mistral_without_parallel_calls_keeps_the_second_as_content(text, content):
    message = read_every_way(reader("mistral", parallel=False), text, 0)[1]
    assert _calls(message) == [("now", "{}")] and message["content"] == content


@pytest.mark.parametrize("separator", ["", "[ARGS]", "[CALL_ID]a1B2c3D4e[ARGS]"])
def test_a_named_call_streams_its_name_then_its_arguments_as_they_come(separator):
    arguments = '{"city": "Oslo }\\"", "days": [1, {"x": "]"}]}'
    text = f"Sure.[TOOL_CALLS]get_weather{separator}{arguments}[TOOL_CALLS]now{separator}{{}}"
    sent = [
        (i, d["tool_calls"][0])
        for i, d in by_character(reader("mistral"), text)
        if "tool_calls" in d
    ]
    ends = len(separator[-1:])  # the name ends at the { after it, or [ARGS]'s ]
    first_at, first = sent[0]
    assert first_at == text.index("get_weather") + len("get_weather" + separator) - ends
    assert first["function"] == {"name": "get_weather", "arguments": ""} and first["index"] == 0
    streamed = [(i, c["function"]["arguments"]) for i, c in sent[1:] if c["index"] == 0]
    assert [text[i] for i, _ in streamed] == [piece for _, piece in streamed] == list(arguments)
    second_at, second = next((i, c) for i, c in sent if c.get("id") and c["index"] == 1)
    assert second_at == text.rindex("now") + len("now" + separator) - ends
    assert second["function"]["name"] == "now"
    if "[CALL_ID]" in separator:  # the id it wrote; the second call wrote it again
        assert first["id"] == "a1B2c3D4e" != second["id"]


@pytest.mark.parametrize(
    "text, ids",
    [  # the id a call wrote after [CALL_ID] is its id when it is 9 letters and digits
        ("[TOOL_CALLS]now[CALL_ID]a1B2c3D4e[ARGS]{}", ["a1B2c3D4e"]),
        ("[TOOL_CALLS]now[CALL_ID]a1B2c3D4e", ["a1B2c3D4e"]),  # cut before [ARGS]: {}
        ("[TOOL_CALLS]now[CALL_ID]a1B2c3D4e[ARGS]", ["a1B2c3D4e"]),
        ("[TOOL_CALLS]now[CALL_ID]a1B2[ARGS]{}", [None]),  # too short: a fresh one
        ("[TOOL_CALLS]now[CALL_ID]a1B2c3D4e5[ARGS]{}", [None]),
        ("[TOOL_CALLS]now[CALL_ID][ARGS]{}", [None]),
        (  # no two calls of a choice share an id
            "[TOOL_CALLS]now[CALL_ID]a1B2c3D4e[ARGS]{}[TOOL_CALLS]now[CALL_ID]a1B2c3D4e[ARGS]{}"
            "[TOOL_CALLS]now[CALL_ID]zzzzzzzzz[ARGS]{}[TOOL_CALLS]now{}",
            ["a1B2c3D4e", None, "zzzzzzzzz", None],
        ),
    ],
)
@pytest.mark.parametrize("seed", range(3))
def test_a_named_calls_id_is_the_one_it_wrote(text, ids, seed):
    for message in _every_message(text, seed):
        got = [c["id"] for c in message["tool_calls"]]
        assert [i if want else None for i, want in zip(got, ids, strict=True)] == ids
        assert len(set(got)) == len(got)
        assert all(re.fullmatch("[A-Za-z0-9]{9}", i) for i in got)


def _every_message(text: str, seed: int, parallel: bool = True) -> list[dict]:
    """The messages of text read whole, in random pieces and a character at a time
    (`read_every_way` compares them without their ids)."""
    make = reader("mistral", parallel)
    whole = make()
    messages = [joined(whole.feed(text) + whole.end())]
    messages.append(stream_pieces(make(), text, seed)[1])
    messages.append(joined([d for _, d in by_character(make, text)]))
    return messages


def _prose(rng: random.Random, bits: list[str], marker: str) -> str:
    text = "".join(rng.choice(bits) for _ in range(rng.randint(0, 6)))
    return text.replace(marker, "")


def _array(rng: random.Random, parallel: bool, calls: list, ids: list) -> tuple[str, str]:
    """A random [TOOL_CALLS] array: (its text, the content it must read into); its calls
    appended to calls (fresh ids: None in ids). Its elements' members may repeat."""
    array, frontier, broken = f"[TOOL_CALLS]{rng.choice(['', ' '])}[", 0, False
    for k in range(rng.randint(1, 3)):
        name = rng.choice(sorted(NAMES) + ["rm"])
        arguments = json.dumps(random_object(rng), ensure_ascii=rng.random() < 0.5)
        element = f'{{"name": "{name}", "arguments": {arguments}}}'
        if rng.random() < 0.25:
            element, arguments = repeated_members(rng, name, json.loads(arguments))
        array += (rng.choice([", ", ",", ",\n"]) if k else "") + element
        if not broken and name in NAMES and (parallel or not calls):
            calls.append((name, arguments))
            ids.append(None)
            frontier = len(array)
        else:  # no call: the array is content from the last call's end
            broken = True
    array += "]"
    return array, (array[frontier:] if broken else "")


def _named(
    rng: random.Random, parallel: bool, calls: list, ids: list, last: bool
) -> tuple[str, str]:
    """Random named calls ([TOOL_CALLS]name{...}, name[ARGS]{...} or
    name[CALL_ID]id[ARGS]{...}): (their text, the content it must read into); their calls
    appended to calls, and the ids they must have to ids (None: a fresh one). Arguments
    may be broken (a ] closes them), and cut when `last` (to nothing: {})."""
    text, content = "", ""
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(sorted(NAMES) + ["rm", "no"])
        arguments = json.dumps(random_object(rng), ensure_ascii=rng.random() < 0.5)
        if rng.random() < 0.2:
            arguments = arguments[:-1] + "]"
        cut = last and rng.random() < 0.3
        if cut:
            arguments = arguments[: rng.randint(0, len(arguments) - 1)]
        call_id = "".join(rng.choice("aZ09") for _ in range(rng.choice([9, 9, 9, 4, 0])))
        separator = rng.choice(["", "[ARGS]", "[ARGS] ", f"[CALL_ID]{call_id}[ARGS]"])
        call = f"[TOOL_CALLS]{rng.choice(['', ' '])}{name}{separator}"
        text += call + arguments
        if name in NAMES and (parallel or not calls):
            calls.append((name, arguments or "{}"))
            kept = "[CALL_ID]" in separator and len(call_id) == 9 and call_id not in ids
            ids.append(call_id if kept else None)
        else:
            content += call + arguments
        if cut:
            break
    return text, content


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("seed", range(200))
def test_random_mistral_answers_stream_as_they_read_whole(seed, parallel):
    # arrays and named calls (both forms), prose between: whole, in random pieces and
    # a character at a time they read into the same content and calls
    rng = random.Random(seed)
    text, content, calls, ids = "", "", [], []
    bits = ["[", "]", "[TOOL_", "CALLS]", "{", "x", " ", "\n", "é", '"']
    groups = rng.randint(1, 3)
    for g in range(groups):
        prose = _prose(rng, bits, "[TOOL_CALLS]")
        if (text + prose).count("[TOOL_CALLS]") > text.count("[TOOL_CALLS]"):
            prose = " " + prose
        if rng.random() < 0.5:
            calls_text, calls_content = _array(rng, parallel, calls, ids)
        else:
            calls_text, calls_content = _named(rng, parallel, calls, ids, g == groups - 1)
        text += prose + calls_text
        content += prose + calls_content
    message = read_every_way(reader("mistral", parallel), text, seed)[1]
    assert _calls(message) == calls
    assert message["content"] == (content if content.strip() else None)
    for message in _every_message(text, seed, parallel):  # the ids the calls wrote
        got = [c["id"] for c in message.get("tool_calls", ())]
        assert [i if want else None for i, want in zip(got, ids, strict=True)] == ids
