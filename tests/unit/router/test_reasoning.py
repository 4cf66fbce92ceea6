"""A reasoning model's thinking split from its answer (router.reasoning, router.chat_reader):
each parser's cases, the same split whatever pieces the text streams in, tool calls read
after the thinking, JSON read for thinking only where its grammar starts after it, and
which prompts closed the thinking. Over a real engine, REST and gRPC, streamed and whole:
tests/unit/router/test_reasoning_structured.py."""

from __future__ import annotations

import random
import re

import pytest

from replica.structured_spec import StructuredOutput
from router.chat_reader import ChatReader, joined, reader_of
from router.reasoning import CLOSE, OPEN, ThinkReader, thinking_closed
from router.tool_parsers import HermesCalls
from router.tools import plan_of
from tests.unit.router.test_tools import WEATHER, pieces

CASES = [
    ("deepseek_r1", "abc</think>answer", "abc", "answer"),
    ("deepseek_r1", "<think>abc</think>answer", "abc", "answer"),
    ("deepseek_r1", "still thinking <", "still thinking <", None),  # never closed
    ("deepseek_r1", "</think>x", None, "x"),
    ("deepseek_r1", "<thi", "<thi", None),
    ("deepseek_r1", "a </thin", "a </thin", None),  # a tag cut by the end is text
    ("qwen3", "<think>\nhm</think>\n\nok", "\nhm", "\n\nok"),
    ("qwen3", "plain <think>answer</think>", None, "plain <think>answer</think>"),
    ("qwen3", "<think>unclosed", "unclosed", None),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "", None, ""),
]


def _split(parser: str, text: str, seed: int) -> dict:
    reader = ChatReader(reasoning=ThinkReader(parser))
    parts = pieces(text, random.Random(seed)) if len(text) > 1 else [text]
    deltas = [d for piece in parts for d in reader.feed(piece)]
    return joined(deltas + reader.end())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("parser, text, reasoning, content", CASES)
def test_thinking_splits_the_same_in_any_pieces(parser, text, reasoning, content, seed):
    message = _split(parser, text, seed)
    assert message.get("reasoning_content") == reasoning
    assert message["content"] == (content or "")
    whole, _ = ChatReader(reasoning=ThinkReader(parser)).whole(text, "stop")
    assert whole["reasoning_content"] == reasoning and whole["content"] == (content or "")


@pytest.mark.parametrize("seed", range(8))
def test_tool_calls_are_read_after_the_thinking(seed):
    text = '<think>the user wants weather</think>\n<tool_call>{"name": "get_weather", "arguments": {"city": "oslo"}}</tool_call>'
    reader = ChatReader(ThinkReader("qwen3"), HermesCalls(names={"get_weather"}))
    deltas = [d for piece in pieces(text, random.Random(seed)) for d in reader.feed(piece)]
    message = joined(deltas + reader.end())
    assert message["reasoning_content"] == "the user wants weather"
    assert message["content"] is None  # only whitespace besides the call
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert reader.finish_reason("stop") == "tool_calls"


def test_json_from_the_first_token_is_not_read_for_thinking():
    plan = plan_of(None, None, None)
    json_object = StructuredOutput("json_object")
    assert reader_of(plan, None, None, None) is None
    assert reader_of(plan, json_object, None, "deepseek_r1") is None
    regex = reader_of(plan, StructuredOutput("regex", "a"), None, "deepseek_r1")
    assert regex is not None and regex.reasoning is not None  # a regex may spell the tags
    named = plan_of([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    forced = reader_of(named, named.grammar(), None, "qwen3")
    assert forced.reasoning is None and forced.tools is not None
    # the grammar starting after </think>, the thinking is read before the answer
    after = reader_of(plan, json_object, None, "deepseek_r1", after_thinking=True)
    assert after.reasoning is not None and after.tools is None
    forced_after = reader_of(named, named.grammar(), None, "qwen3", after_thinking=True)
    assert forced_after.reasoning is not None and forced_after.tools is not None
    assert reader_of(plan, json_object, None, None, after_thinking=True) is None


def char_ids(text: str) -> tuple[int, ...]:
    """A tokenizer of one id per character: every tag is several ids."""
    return tuple(ord(c) for c in text)


def tag_token_ids(text: str) -> tuple[int, ...]:
    """A tokenizer whose <think> and </think> are one id each (1, 2), as reasoning models'."""
    pieces = re.split(f"({OPEN}|{CLOSE})", text)
    return tuple(i for p in pieces for i in ({OPEN: (1,), CLOSE: (2,)}.get(p) or char_ids(p)))


@pytest.mark.parametrize("encode", [tag_token_ids, char_ids])
@pytest.mark.parametrize(
    "prompt, closed",
    [
        ("<|assistant|><think>\n\n</think>\n\n", True),  # Qwen 3, enable_thinking false
        ("<|assistant|><think>\n", False),  # DeepSeek-R1's template opens it
        ("<|assistant|>", False),  # the model may open it (qwen3) or is in it (deepseek_r1)
        ("<think>a</think>old answer<|user|>q<|assistant|><think>\n", False),
        ("<think>a</think><|assistant|>", True),
        ("</think><|assistant|>", False),  # no <think>: nothing closed
        ("<think><think></think", False),  # a cut-off tag is no tag
    ],
)
def test_a_prompt_closed_the_thinking_when_its_last_think_is_closed(encode, prompt, closed):
    """The ids' rule is the text's (the text after the last <think> holds </think>)."""
    start = prompt.rfind(OPEN)
    assert (start >= 0 and CLOSE in prompt[start + len(OPEN) :]) is closed
    assert thinking_closed(encode(prompt), encode(OPEN), encode(CLOSE)) is closed
