"""Readers of a chat choice's generated text for tool calls (`router.tools.ToolPlan.stream`):
`feed` each piece of text, `end` once the choice finished; each returns chat deltas,
{"content": ...} or {"tool_calls": [...]}, for a stream and (joined) for a whole response
alike. A call is sent once whole ("required", "auto"); a named call's arguments stream as
they are generated. Text a reader cannot read as a call stays content: nothing is dropped.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from router.reasoning import tag_tail


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_delta(index: int, name: str, arguments: str) -> dict[str, Any]:
    """A whole call (its first delta in a stream): id, type, name, arguments."""
    function = {"name": name, "arguments": arguments}
    return {"index": index, "id": new_call_id(), "type": "function", "function": function}


@dataclass
class ToolStream:
    """Reads one choice's generated text into chat deltas ({"content": ...} or
    {"tool_calls": [...]}): `feed` each piece, `end` once the choice finished."""

    calls: int = 0
    """Calls sent so far."""

    def feed(self, text: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def end(self) -> list[dict[str, Any]]:
        return []

    def finish_reason(self, engine: str | None) -> str | None:
        """A choice that stopped having called tools finishes with "tool_calls" (OpenAI's)."""
        return "tool_calls" if engine == "stop" and self.calls else engine

    def _call(self, name: str, arguments: str) -> dict[str, Any]:
        self.calls += 1
        return {"tool_calls": [call_delta(self.calls - 1, name, arguments)]}


@dataclass
class NamedCall(ToolStream):
    """tool_choice naming a function: every piece is more of its arguments. Finishes
    "stop", as OpenAI's forced function call does."""

    name: str = ""

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.calls == 0:
            first = self._call(self.name, text)
            return [first]
        if not text:
            return []
        return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]

    def end(self) -> list[dict[str, Any]]:
        return self.feed("") if self.calls == 0 else []

    def finish_reason(self, engine: str | None) -> str | None:
        return engine


@dataclass
class CallArray(ToolStream):
    """tool_choice "required": the JSON array of {"name", "parameters"}; each element is
    sent as a call once it closes. What never closes (a length cut) ends as content."""

    buffer: str = ""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    start: int = -1
    """Where the open element begins in `buffer` (-1: none open)."""

    def feed(self, text: str) -> list[dict[str, Any]]:
        out = []
        base = len(self.buffer)
        self.buffer += text
        for i, ch in enumerate(text, base):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2:
                    self.start = i
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and self.start >= 0:
                    out.append(self._element(self.buffer[self.start : i + 1]))
                    self.start = -1
        return out

    def _element(self, text: str) -> dict[str, Any]:
        item = json.loads(text)
        arguments = json.dumps(item["parameters"], ensure_ascii=False)
        return self._call(item["name"], arguments)

    def end(self) -> list[dict[str, Any]]:
        if self.start >= 0:
            return [{"content": self.buffer[self.start :]}]
        if not self.calls and self.buffer:
            return [{"content": self.buffer}]
        return []


OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class HermesCalls(ToolStream):
    """tool_choice "auto" read as Hermes writes calls: text, then any number of
    <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks. Text outside them is
    content (a tail that may begin a tag is held until it is known); a block that is not
    a call of one of `names` (or a second one when `parallel` is off) stays content."""

    names: set[str] = field(default_factory=set)
    parallel: bool = True
    held: str = ""
    inside: bool = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.held += text
        out: list[dict[str, Any]] = []
        while True:
            if self.inside:
                close = self.held.find(CLOSE)
                if close < 0:
                    return out
                out += self._block(self.held[:close], OPEN + self.held[: close + len(CLOSE)])
                self.held = self.held[close + len(CLOSE) :]
                self.inside = False
                continue
            opened = self.held.find(OPEN)
            if opened < 0:
                keep = tag_tail(self.held, OPEN)
                out += _content(self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                return out
            out += _content(self.held[:opened])
            self.held = self.held[opened + len(OPEN) :]
            self.inside = True

    def _block(self, body: str, raw: str) -> list[dict[str, Any]]:
        call = _hermes_call(body)
        if call is None or call[0] not in self.names or (self.calls and not self.parallel):
            return _content(raw)
        return [self._call(*call)]

    def end(self) -> list[dict[str, Any]]:
        held, self.held = self.held, ""
        if self.inside:  # a block the end cut (EOS right after the JSON is common)
            self.inside = False
            return self._block(held, OPEN + held)
        return _content(held)


def _content(text: str) -> list[dict[str, Any]]:
    return [{"content": text}] if text else []


def _hermes_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a block's {"name", "arguments"} object, else None."""
    try:
        item = json.loads(body)
    except ValueError:
        return None
    return _call_of(item)


def _call_of(item: object) -> tuple[str, str] | None:
    """(name, arguments JSON) of a {"name", "arguments" or "parameters"} object, else None."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        return item["name"], arguments
    if not isinstance(arguments, dict):
        return None
    return item["name"], json.dumps(arguments, ensure_ascii=False)


PYTHON_TAG = "<|python_tag|>"


@dataclass
class Llama3Calls(ToolStream):
    """tool_choice "auto" read as Llama 3.1 / 3.2 write JSON calls: an answer that begins
    with `{` (or <|python_tag|>) is one or more {"name": ..., "parameters": {...}}
    objects, separated by ";"; any other answer is text. A call answer is held to the end
    and read whole; one that does not read as calls of `names` (or holds a second call
    when `parallel` is off) is content, as it came."""

    names: set[str] = field(default_factory=set)
    parallel: bool = True
    held: str = ""
    calls_answer: bool | None = None
    """None: undecided (only whitespace, or a prefix of PYTHON_TAG, so far)."""

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.calls_answer is False:
            return _content(text)
        self.held += text
        start = self.held.lstrip()
        if not start or (PYTHON_TAG.startswith(start) and len(start) < len(PYTHON_TAG)):
            return []
        self.calls_answer = start.startswith(("{", PYTHON_TAG))
        if self.calls_answer:
            return []
        held, self.held = self.held, ""
        return _content(held)

    def end(self) -> list[dict[str, Any]]:
        held, self.held = self.held, ""
        if not self.calls_answer:
            return _content(held)
        calls = _llama3_calls(held.lstrip().removeprefix(PYTHON_TAG))
        if calls is None or any(name not in self.names for name, _ in calls):
            return _content(held)
        if len(calls) > 1 and not self.parallel:
            return _content(held)
        return [self._call(name, arguments) for name, arguments in calls]


def _llama3_calls(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each ";"-separated {"name", "parameters"} object, else None."""
    decoder, calls, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return calls or None
        try:
            item, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        call = _call_of(item)
        if call is None:
            return None
        calls.append(call)
