"""Reasoning models' thinking, split from their answer: the cluster's `reasoning_parser`
reads a chat choice's text into `reasoning_content` (vLLM's field) and `content`.

    deepseek_r1   the output begins inside the reasoning (DeepSeek-R1's template opens
                  <think> in the prompt; a leading <think> is dropped too) and </think>
                  ends it; an output that never closes it is all reasoning
    qwen3         reasoning only when the output begins with <think> (Qwen 3, QwQ; with
                  chat_template_kwargs {"enable_thinking": false} it does not), up to
                  </think>; otherwise all content

The reader works on text pieces as they stream: a tail that may begin a tag is held
until the next piece tells.

A chat with a structured output (its own, or a forced tool call's grammar) thinks first,
as in vLLM: the grammar starts after the output's </think> (`SamplingParams.structured_after`,
set by `router.frontend.Frontend.thinking_first`), so the thinking is free and the answer
is held to the grammar. A prompt that closed the thinking itself (`thinking_closed`) leaves
none to do: the grammar holds the output from its first token, and JSON held so is not
read for thinking (`router.chat_reader.reader_of`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PARSERS = ("deepseek_r1", "qwen3")
OPEN, CLOSE = "<think>", "</think>"


@dataclass
class ThinkReader:
    """Text pieces -> deltas {"reasoning_content": ...} and {"content": ...}.
    parser: one of PARSERS."""

    parser: str
    state: str = "start"
    """"start" (nothing decided yet), "thinking", or "answer"."""
    held: str = ""

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.held += text
        out: list[dict[str, Any]] = []
        if self.state == "start":
            if OPEN.startswith(self.held) and len(self.held) < len(OPEN):
                return out  # may still begin <think>
            if self.held.startswith(OPEN):
                self.held, self.state = self.held[len(OPEN) :], "thinking"
            else:
                self.state = "thinking" if self.parser == "deepseek_r1" else "answer"
        if self.state == "thinking":
            close = self.held.find(CLOSE)
            if close < 0:
                keep = tag_tail(self.held, CLOSE)
                out += _delta("reasoning_content", self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                return out
            out += _delta("reasoning_content", self.held[:close])
            self.held, self.state = self.held[close + len(CLOSE) :], "answer"
        out += _delta("content", self.held)
        self.held = ""
        return out

    def end(self) -> list[dict[str, Any]]:
        """What is held once the choice finished: a cut-off tag is text of its part."""
        held, self.held = self.held, ""
        if self.state == "start":
            kind = "reasoning_content" if self.parser == "deepseek_r1" else "content"
            return _delta(kind, held)
        return _delta("reasoning_content" if self.state == "thinking" else "content", held)


def thinking_closed(prompt: str) -> bool:
    """Whether a rendered prompt closed the thinking itself: its text after its last
    <think> holds </think>. Example: Qwen 3's template with chat_template_kwargs
    {"enable_thinking": false} ends the prompt "<think>\n\n</think>\n\n" -> True; a
    prompt that opens <think> (DeepSeek-R1's) or has none -> False."""
    start = prompt.rfind(OPEN)
    return start >= 0 and CLOSE in prompt[start + len(OPEN) :]


def tag_tail(text: str, tag: str) -> int:
    """Length of the longest tail of text that begins tag (0: none): what a streamed
    reader holds back until the next piece tells (also `router.tool_parsers`)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def _delta(kind: str, text: str) -> list[dict[str, Any]]:
    return [{kind: text}] if text else []
