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

from tests.unit.router.test_tool_hermes import random_object
from tests.unit.router.test_tool_parsers import NAMES, read_every_way, reader

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
    ],
)  # fmt: skip
def test_mistral_calls_read_the_same_in_any_pieces(text, content, calls, seed):
    message = read_every_way(reader("mistral"), text, seed)[1]
    assert message["content"] == content and _calls(message) == calls


def test_mistral_without_parallel_calls_keeps_the_second_as_content():
    message = read_every_way(reader("mistral", parallel=False), f"[TOOL_CALLS][{NOW}, {NOW}]", 0)[1]
    assert _calls(message) == [("now", "{}")] and message["content"] == f", {NOW}]"


def _prose(rng: random.Random, bits: list[str], marker: str) -> str:
    text = "".join(rng.choice(bits) for _ in range(rng.randint(0, 6)))
    return text.replace(marker, "")


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("seed", range(100))
def test_random_mistral_answers_stream_as_they_read_whole(seed, parallel):
    rng = random.Random(seed)
    text, content, calls = "", "", []
    bits = ["[", "]", "[TOOL_", "CALLS]", "{", "x", " ", "\n", "é", '"']
    for _ in range(rng.randint(1, 3)):
        prose = _prose(rng, bits, "[TOOL_CALLS]")
        if (text + prose).count("[TOOL_CALLS]") > text.count("[TOOL_CALLS]"):
            prose = " " + prose
        array, frontier, broken = f"[TOOL_CALLS]{rng.choice(['', ' '])}[", 0, False
        for k in range(rng.randint(1, 3)):
            name = rng.choice(sorted(NAMES) + ["rm"])
            arguments = json.dumps(random_object(rng), ensure_ascii=rng.random() < 0.5)
            sep = rng.choice([", ", ",", ",\n"]) if k else ""
            array += sep + f'{{"name": "{name}", "arguments": {arguments}}}'
            if not broken and name in NAMES and (parallel or not calls):
                calls.append((name, arguments))
                frontier = len(array)
            else:  # no call: the array is content from the last call's end
                broken = True
        array += "]"
        text += prose + array
        content += prose + (array[frontier:] if broken else "")
    message = read_every_way(reader("mistral", parallel), text, seed)[1]
    assert _calls(message) == calls
    assert message["content"] == (content if content.strip() else None)
