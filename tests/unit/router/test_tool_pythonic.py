"""tool_call_parser "pythonic" (router.tool_parsers.pythonic), pure logic: a Python list
of calls, read with `ast` and never run, reads the same in any pieces (and whole, and a
character at a time); an answer that is no list of literal-only calls of the request's
tools is content as it came; once a call was sent, what breaks the list is content from
where the last call's text ended. Fresh random answers read back as written."""

from __future__ import annotations

import ast
import json
import os
import random
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from router.tool_parsers.pythonic import pythonic_calls
from tests.unit.router.test_tool_hermes import random_value
from tests.unit.router.test_tool_parsers import NAMES, by_character, read_every_way, reader
from tests.unit.router.test_tools import named_calls


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('[get_weather(city="oslo", days=3), now()]', None, [("get_weather", {"city": "oslo", "days": 3}), ("now", {})]),
        ("<|python_start|>[now()]<|python_end|>", None, [("now", {})]),  # Llama 4's, kept in the text
        (
            "  [now(a={'b': [1, -2.5e3, None, True]}, c=(1, 2), d='\\n\"')]\n",
            None,
            [("now", {"a": {"b": [1, -2500.0, None, True]}, "c": [1, 2], "d": '\n"'})],
        ),
        ("[now() # a comment, ]\n, now(),\n] # another", None, [("now", {})] * 2),
        ("<|python_start|>([now()])", None, [("now", {})]),  # read whole at the end
        # a call is sent once the , or ] after it arrives: what breaks the list is content
        ("[now(x=1)] and more", " and more", [("now", {"x": 1})]),
        ("[now(x=1)][0]", "[0]", [("now", {"x": 1})]),
        ("[now(x=1), 3]", ", 3]", [("now", {"x": 1})]),
        ("[now(x=1) , rm()]", " , rm()]", [("now", {"x": 1})]),
        ("[now(x='é'\n)\n, now(", "\n, now(", [("now", {"x": "é"})]),  # cut by max_tokens
        # each element is parsed alone: , ] # and quotes inside strings and comments are theirs
        ('[now(a="""a], "b\n"""), now(b=\'c),\')]', None, [("now", {"a": 'a], "b\n'}), ("now", {"b": "c),"})]),
        ("[now(a=r'x\\', ]'), now()]", None, [("now", {"a": "x\\', ]"}), ("now", {})]),
        ("[now(a='#'), now() # it's ], no\n, now(b='')]", None, [("now", {"a": "#"}), ("now", {}), ("now", {"b": ""})]),
        ("[now()\\\n, (now(a=1))]", None, [("now", {}), ("now", {"a": 1})]),
        ("[(now(a=1)), now()]", None, [("now", {"a": 1}), ("now", {})]),
        ('[now(a="\\d")]', None, [("now", {"a": "\\d"})]),
        ("[now(), lambda a, b: 1] x", ", lambda a, b: 1] x", [("now", {})]),
        ("[now(), now(a=[1)]", ", now(a=[1)]", [("now", {})]),  # brackets that do not match
        ("[now(), now(a=1)) , now()]", ", now(a=1)) , now()]", [("now", {})]),
    ],
)  # fmt: skip
def test_pythonic_calls_read_the_same_in_any_pieces(text, content, calls, seed):
    message = read_every_way(reader("pythonic"), text, seed)[1]
    assert message["content"] == content
    assert named_calls(message.get("tool_calls", [])) == calls


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
        "[now(x=1) if a else b]",
        "[now(x=1).y, now()]",
        "[now(",  # cut by max_tokens
        "[now()) , now()]",
        "[now(a='x), now()]",  # an open string
        "[now(a=1if 1 else 2)]",
        "[]",
        "[] and more",
        "<|python_st",
    ],
)
def test_pythonic_answers_that_are_no_calls_stay_content(text, seed):
    message = read_every_way(reader("pythonic"), text, seed)[1]
    assert message == {"role": "assistant", "content": text}


def test_pythonic_without_parallel_calls_keeps_the_second_as_content():
    message = read_every_way(reader("pythonic", parallel=False), "[now(), now()]", 0)[1]
    assert named_calls(message["tool_calls"]) == [("now", {})]
    assert message["content"] == ", now()]"
    assert pythonic_calls("[f(a=1, b=[True, None])]") == [("f", '{"a": 1, "b": [true, null]}')]


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("seed", range(100))
def test_random_pythonic_answers_stream_as_they_read_whole(seed, parallel):
    rng = random.Random(seed)
    sp = rng.choice(["", " ", "\n"])
    text, calls, frontier, broken = rng.choice(["", " ", "<|python_start|>"]) + "[", [], 0, False
    for k in range(rng.randint(1, 3)):
        name = rng.choice(sorted(NAMES) + ["rm"])
        arguments = {f"a{i}": random_value(rng) for i in range(rng.randint(0, 3))}
        text += (f",{sp}" if k else "") + name + "("
        text += f",{sp}".join(f"{key}={value!r}" for key, value in arguments.items()) + ")"
        if not broken and name in NAMES and (parallel or not calls):
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
            frontier = len(text)
        else:
            broken = True
    text += "]"
    tail = rng.choice(["", "\n", "<|python_end|>", " and more"])
    text += tail
    message = read_every_way(reader("pythonic", parallel), text, seed)[1]
    got = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", ())
    ]
    assert got == calls
    if broken:
        assert message["content"] == (text[frontier:] if calls else text)
    else:
        assert message["content"] == (tail if tail == " and more" else None)


@pytest.mark.parametrize("calls", [10, 40])
def test_a_pythonic_answer_is_parsed_in_linear_time(monkeypatch, calls):
    # each element is parsed alone, once its , or ] arrives (and the whole answer once at
    # its end): `ast` parses about twice the answer, not the answer again at each , or ]
    # of its calls' arguments (70 times it here, for 40 calls)
    sources: list[str] = []
    parse = ast.parse

    def counted(source, *args, **kwargs):
        sources.append(source)
        return parse(source, *args, **kwargs)

    monkeypatch.setattr(ast, "parse", counted)
    call = 'get_weather(city="x],", days=[[1], [2, (3, 4)]])'
    text = "[" + ", ".join([call] * calls) + "]"
    sent = [d for _, d in by_character(reader("pythonic"), text) if "tool_calls" in d]
    assert len(sent) == calls
    assert len(sources) == calls + 1 and sum(map(len, sources)) < 2 * len(text) + 4 * calls


WARNING_TEXTS = ['[now(a="\\d", b="\\777")]', "[now(a=1if 1 else 2)]", "[now(), now(b=0x1for)]"]
"""Text `ast` warns on: invalid escapes (SyntaxWarning on Python 3.12+, DeprecationWarning
before) and invalid literals (SyntaxWarning)."""


def read_warning_texts() -> None:
    """Reads WARNING_TEXTS every way: escapes read as Python reads them (an invalid one
    keeps its backslash, an octal one past \\377 is its code point)."""
    for text in WARNING_TEXTS:
        read_every_way(reader("pythonic"), text, 0)
    _, message = read_every_way(reader("pythonic"), WARNING_TEXTS[0], 0)
    assert named_calls(message["tool_calls"]) == [("now", {"a": "\\d", "b": chr(0o777)})]


def _python(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True)


@pytest.mark.parametrize("option", ["always", "error"])
def test_the_models_text_cannot_make_ast_warn(option):
    """Its warnings never reach the logs, nor turn the text into an error, whatever
    warnings the process started with (-W: in a fresh process, as a server starts)."""
    code = "import tests.unit.router.test_tool_pythonic as t; t.read_warning_texts()"
    run = _python("-W", option, "-c", code)
    assert run.returncode == 0 and run.stderr == "", run.stderr


def test_other_source_still_warns():
    # the filter is the model's text's alone
    run = _python("-W", "always", "-c", "import ast, router.tool_parsers; ast.parse('\"\\\\d\"')")
    assert run.returncode == 0
    assert "<unknown>:1: " in run.stderr and "invalid escape sequence '\\d'" in run.stderr


def test_a_parse_leaves_the_warning_filters_alone(monkeypatch):
    """ast parses the model's text while the process-wide filter list is the one every
    thread shares, as it was (warnings.catch_warnings() around a parse swapped it, which
    two threads parsing at once could leave swapped for good). Once its own filter is in:
    pytest's collection, which imported the parser, dropped it on its way out."""
    pythonic_calls("[now()]")
    filters, during = warnings.filters, []
    before = list(filters)
    parse = ast.parse

    def watched_parse(*args, **kwargs):
        during.append(warnings.filters is filters and warnings.filters == before)
        return parse(*args, **kwargs)

    monkeypatch.setattr(ast, "parse", watched_parse)
    for text in WARNING_TEXTS:
        read_every_way(reader("pythonic"), text, 0)
    assert during and all(during)
    assert warnings.filters is filters and warnings.filters == before
