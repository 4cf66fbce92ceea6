"""A chat choice's generated text read into its message: reasoning (`router.reasoning`)
first, then the rest through the tool-call reader (`router.tool_calls`), as deltas for a
stream and joined for a whole response, so the two always agree.

    reasoning_content   the thinking, with the cluster's reasoning_parser (else absent)
    content             the answer's text (null when the answer is only tool calls)
    tool_calls          the calls, when the request's tools are read
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from replica.structured_spec import WHITESPACE_KINDS, StructuredOutput
from router.reasoning import ThinkReader
from router.tool_calls import ToolStream
from router.tools import ToolPlan

Delta = dict[str, Any]


@dataclass
class ChatReader:
    """feed each piece of a choice's text, end once it finished (`Delta`s either way)."""

    reasoning: ThinkReader | None = None
    tools: ToolStream | None = None

    def feed(self, text: str) -> list[Delta]:
        if self.reasoning is None:
            return self._answer([{"content": text}] if text else [])
        return self._answer(self.reasoning.feed(text))

    def end(self) -> list[Delta]:
        out = self._answer(self.reasoning.end()) if self.reasoning is not None else []
        return out + (self.tools.end() if self.tools is not None else [])

    def _answer(self, deltas: list[Delta]) -> list[Delta]:
        """The deltas with their content read by the tool reader (if any)."""
        if self.tools is None:
            return deltas
        out: list[Delta] = []
        for d in deltas:
            out += self.tools.feed(d["content"]) if "content" in d else [d]
        return out

    def finish_reason(self, engine: str | None) -> str | None:
        return self.tools.finish_reason(engine) if self.tools is not None else engine

    def whole(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A non-streamed choice's message and finish reason: its deltas, joined."""
        message = joined(self.feed(text) + self.end())
        if self.reasoning is not None:
            message.setdefault("reasoning_content", None)
        return message, self.finish_reason(finish_reason)


def reader_of(
    plan: ToolPlan,
    structured: StructuredOutput | None,
    tool_parser: str | None,
    reasoning_parser: str | None,
    after_thinking: bool = False,
) -> ChatReader | None:
    """The reader of a chat request's choices (None: plain text, sent as it comes).
    structured: the request's structured output, forced tool calls' included;
    after_thinking: its grammar starts after the thinking (`SamplingParams.structured_after`).
    JSON from the first token leaves no room for thinking, so such output is not read
    for it; JSON after the thinking is the answer, read after it."""
    json_first = (
        structured is not None and structured.kind in WHITESPACE_KINDS and not after_thinking
    )
    reasoning = ThinkReader(reasoning_parser) if reasoning_parser and not json_first else None
    tools = plan.stream(tool_parser)
    if reasoning is None and tools is None:
        return None
    return ChatReader(reasoning, tools)


def joined(deltas: list[Delta]) -> dict[str, Any]:
    """A whole assistant message from its deltas: content None when the message called
    tools and said nothing else (OpenAI's); reasoning_content when there was any."""
    text = "".join(d.get("content", "") for d in deltas)
    thought = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    calls: list[dict[str, Any]] = []
    for d in deltas:
        for c in d.get("tool_calls", ()):
            if "id" in c:
                calls.append({k: v for k, v in c.items() if k != "index"})
                calls[-1]["function"] = dict(c["function"])
            else:
                calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    message: dict[str, Any] = {"role": "assistant"}
    message["content"] = None if calls and not text.strip() else text
    if thought:
        message["reasoning_content"] = "".join(thought)
    if calls:
        message["tool_calls"] = calls
    return message
