"""A reasoning model's thinking split from its answer (router.reasoning, router.chat_reader):
each parser's cases, the same split whatever pieces the text streams in, tool calls read
after the thinking, and on REST over a real CPU engine streamed and whole alike."""

from __future__ import annotations

import random
import re

import pytest

from replica.structured_spec import StructuredOutput
from router.chat_reader import ChatReader, joined, reader_of
from router.reasoning import ThinkReader
from router.tool_parsers import HermesCalls
from router.tools import plan_of
from tests.unit.replica.engines import small_engine
from tests.unit.router.served_engine import served_frontend
from tests.unit.router.test_rest_text_options import post
from tests.unit.router.test_rest_tools import MESSAGES, message_of
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


def test_json_output_is_not_read_for_thinking():
    plan = plan_of(None, None, None)
    assert reader_of(plan, None, None, None) is None
    assert reader_of(plan, StructuredOutput("json_object"), None, "deepseek_r1") is None
    regex = reader_of(plan, StructuredOutput("regex", "a"), None, "deepseek_r1")
    assert regex is not None and regex.reasoning is not None  # a regex may spell the tags
    named = plan_of([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    forced = reader_of(named, named.grammar(), None, "qwen3")
    assert forced.reasoning is None and forced.tools is not None


THINKING = r"<think>[a-z]{2,8}( [a-z]{2,8}){0,2}</think>\n[a-z]{2,8}"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_answers_split_thinking_streamed_or_not(llama_dir, stream):
    with served_frontend(small_engine(llama_dir), reasoning_parser="qwen3") as front:
        body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 120, "stream": stream,
                "structured_outputs": {"regex": THINKING}}  # fmt: skip
        status, result = post(front, "chat", body)
        plain = post(front, "chat", {"messages": MESSAGES, "temperature": 0, "max_tokens": 8})
    assert status == 200
    if stream:
        thought = "".join(
            c["delta"].get("reasoning_content", "") for chunk in result for c in chunk["choices"]
        )
        message, finish = message_of(result)
    else:
        message, finish = message_of(result)
        thought = message["reasoning_content"]
    assert finish == "stop"
    assert re.fullmatch(r"[a-z]{2,8}( [a-z]{2,8}){0,2}", thought)
    assert re.fullmatch(r"\n[a-z]{2,8}", message["content"])
    # qwen3: an answer that does not begin <think> is all content
    assert "reasoning_content" not in plain[1]["choices"][0]["message"] or (
        plain[1]["choices"][0]["message"]["reasoning_content"] is None
    )
