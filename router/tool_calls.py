"""Readers of a chat choice's generated text for tool calls (`router.tools.ToolPlan.stream`):
`feed` each piece of text, `end` once the choice finished; each returns chat deltas,
{"content": ...} or {"tool_calls": [...]}, for a stream and (joined) for a whole response
alike. The forced readers are here: a named call's arguments stream as they are
generated, "required" sends each call of its array once whole. tool_choice "auto" reads
the model's own format (`router.tool_parsers`), on the `AutoCalls` base here. Text a
reader cannot read as a call stays content: nothing is dropped.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any

from router.call_ids import CallIds


def call_delta(index: int, name: str, arguments: str, call_id: str) -> dict[str, Any]:
    """A whole call (its first delta in a stream): id, type, name, arguments."""
    function = {"name": name, "arguments": arguments}
    return {"index": index, "id": call_id, "type": "function", "function": function}


def arguments_delta(index: int, text: str) -> dict[str, Any]:
    """More of call `index`'s arguments (a stream's later deltas of a call)."""
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


def content(text: str) -> list[dict[str, Any]]:
    return [{"content": text}] if text else []


@dataclass
class ToolStream:
    """Reads one choice's generated text into chat deltas ({"content": ...} or
    {"tool_calls": [...]}): `feed` each piece, `end` once the choice finished."""

    calls: int = 0
    """Calls sent so far."""
    ids: CallIds = field(default_factory=CallIds)
    """The calls' ids, in the shape the served model's template takes
    (`router.call_ids`)."""

    def feed(self, text: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def end(self) -> list[dict[str, Any]]:
        return []

    def finish_reason(self, engine: str | None) -> str | None:
        """A choice that stopped having called tools finishes with "tool_calls" (OpenAI's)."""
        return "tool_calls" if engine == "stop" and self.calls else engine

    def start_call(self, name: str, arguments: str, call_id: str = "") -> dict[str, Any]:
        """A new call's first delta (its index the next), counted in `calls`; its id
        `call_id` (one the model wrote) when `ids` takes it, else a fresh one."""
        self.calls += 1
        call_id = self.ids.next(call_id)
        return {"tool_calls": [call_delta(self.calls - 1, name, arguments, call_id)]}


@dataclass
class NamedCall(ToolStream):
    """tool_choice naming a function: every piece is more of its arguments. Finishes
    "stop", as OpenAI's forced function call does."""

    name: str = ""

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.calls == 0:
            first = self.start_call(self.name, text)
            return [first]
        if not text:
            return []
        return [arguments_delta(0, text)]

    def end(self) -> list[dict[str, Any]]:
        return self.feed("") if self.calls == 0 else []

    def finish_reason(self, engine: str | None) -> str | None:
        return engine


BLOCK = 1024
"""Characters a `Text` seals into a block: appending a piece copies at most this much."""


class Text:
    """A reader's text while it grows at its end, in time and space linear in its length.
    (A str attribute grown by `+=` copies all of itself on each piece: an answer streamed
    a character at a time was read in time quadratic in its length.) Sealed blocks of
    BLOCK characters (more where one piece was more), then an open tail: appending copies
    at most the tail; text[i] and text[a:b] (a str) cost the characters taken, plus a
    bisect where they reach before the tail. Indexes and slices are a str's (no steps).

    Example (BLOCK 4): "ab", "cde", "f" appended -> blocks ["abcde"] at [0], tail "f"."""

    def __init__(self, text: str = "") -> None:
        self._blocks: list[str] = []
        self._starts: list[int] = []  # where each block begins in the text
        self._tail = ""
        self._tail_start = 0
        self += text

    def __len__(self) -> int:
        return self._tail_start + len(self._tail)

    def __str__(self) -> str:
        return self[:]

    def __iadd__(self, piece: str) -> Text:
        self._tail += piece
        if len(self._tail) >= BLOCK:
            self._blocks.append(self._tail)
            self._starts.append(self._tail_start)
            self._tail_start, self._tail = self._tail_start + len(self._tail), ""
        return self

    def __getitem__(self, key: int | slice) -> str:
        length = self._tail_start + len(self._tail)
        if isinstance(key, slice):
            start, stop, step = key.indices(length)
            assert step == 1, "Text slices take no step"
        else:
            start, stop = (key + length, key + length + 1) if key < 0 else (key, key + 1)
            if not 0 <= start < length:
                raise IndexError(f"Text index {key} out of range for length {length}")
        if stop <= start:
            return ""
        if start >= self._tail_start:
            return self._tail[start - self._tail_start : stop - self._tail_start]
        first = bisect_right(self._starts, start) - 1
        last = bisect_right(self._starts, stop - 1)
        pieces = [
            block[max(start - at, 0) : stop - at]
            for at, block in zip(self._starts[first:last], self._blocks[first:last], strict=True)
        ]
        if stop > self._tail_start:
            pieces.append(self._tail[: stop - self._tail_start])
        return "".join(pieces)

    def startswith(self, prefix: str, start: int = 0) -> bool:
        return self[start : start + len(prefix)] == prefix


@dataclass
class JsonScan:
    """Where a JSON text stands, read a character at a time: `depth` of the open [ and {
    outside strings, whether inside a string (and just after a backslash in it)."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def step(self, ch: str) -> bool:
        """Reads ch; True when it is structure (outside any string, not a quote)."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
            return False
        if ch == '"':
            self.in_string = True
            return False
        if ch in "[{":
            self.depth += 1
        elif ch in "]}":
            self.depth -= 1
        return True


@dataclass
class CallArray(ToolStream):
    """tool_choice "required": the JSON array of {"name", "parameters"}; each element is
    sent as a call once it closes. What never closes (a length cut) ends as content."""

    buffer: Text = field(default_factory=Text)
    scan: JsonScan = field(default_factory=JsonScan)
    start: int = -1
    """Where the open element begins in `buffer` (-1: none open)."""
    told: bool = False
    """An element was sent as content (it did not read as a call)."""

    def feed(self, text: str) -> list[dict[str, Any]]:
        out = []
        base = len(self.buffer)
        self.buffer += text
        for i, ch in enumerate(text, base):
            if not self.scan.step(ch):
                continue
            if ch in "[{" and self.scan.depth == 2:
                self.start = i
            elif ch in "]}" and self.scan.depth == 1 and self.start >= 0:
                out.append(self._element(self.buffer[self.start : i + 1]))
                self.start = -1
        return out

    def _element(self, text: str) -> dict[str, Any]:
        """The element's call; its text as content where it does not read as one. The
        grammar forces the shape, so that is a guard, not a path: a grammar library's
        flaw (xgrammar's bounded strings let raw control characters through, which
        json.loads refuses) once made it a 500."""
        try:
            item = json.loads(text)
            name, arguments = item["name"], json.dumps(item["parameters"], ensure_ascii=False)
        except (ValueError, KeyError, TypeError):
            self.told = True
            return {"content": text}
        return self.start_call(name, arguments)

    def end(self) -> list[dict[str, Any]]:
        if self.start >= 0:
            return [{"content": self.buffer[self.start :]}]
        if not self.calls and not self.told and self.buffer:
            return [{"content": str(self.buffer)}]
        return []


@dataclass
class AutoCalls(ToolStream):
    """tool_choice "auto": the text the model chose to write, read for calls of `names`
    (the request's tools); with `parallel` off (parallel_tool_calls false) only the first
    call is one, a second stays content."""

    names: set[str] = field(default_factory=set)
    parallel: bool = True

    def may_call(self, name: object, before: int = 0) -> bool:
        """Whether a call of name, next (after `before` more), is sent as a call (else its
        text is content)."""
        return name in self.names and (self.parallel or not self.calls + before)


@dataclass
class AnswerCalls(AutoCalls):
    """An answer that is either text or calls, told apart by how it begins (after
    whitespace): one that begins with one of `starts` is read as calls as it arrives
    (`read`); from where it turns out no call of `names` (or a second one without
    `parallel`) it is content (`give_up`): the whole answer when no call was sent yet.
    Any other answer streams as text."""

    starts: tuple[str, ...] = ()
    answer: Text = field(default_factory=Text)
    """The answer so far, while it is undecided or read as calls."""
    lead: int = 0
    """answer[:lead] is whitespace (all the whitespace it begins with, once decided)."""
    calls_answer: bool | None = None
    """None: undecided (only whitespace, or a prefix of one of `starts`, so far)."""

    def read(self, text: str) -> list[dict[str, Any]]:
        """Reads the calls answer on: `text` is the end of `answer` not given to read
        before (the new piece; at the first read, all of the answer). Per character, a
        reader reads `text`, not `answer`: a str's index costs less than a `Text`'s."""
        raise NotImplementedError

    def read_end(self) -> list[dict[str, Any]]:
        """The calls answer ended."""
        raise NotImplementedError

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.calls_answer is False:
            return content(text)
        self.answer += text
        if self.calls_answer:
            return self.read(text)
        rest = self.answer[self.lead :]
        start = rest.lstrip()
        self.lead += len(rest) - len(start)
        if not start or any(s.startswith(start) and len(start) < len(s) for s in self.starts):
            return []
        self.calls_answer = start.startswith(self.starts)
        return self.read(str(self.answer)) if self.calls_answer else self.give_up(0)

    def end(self) -> list[dict[str, Any]]:
        return self.read_end() if self.calls_answer else self.give_up(0)

    def give_up(self, at: int) -> list[dict[str, Any]]:
        """The answer from `at` on is content, and so is all that follows."""
        self.calls_answer = False
        rest, self.answer = self.answer[at:], Text()
        return content(rest)


def call_of(item: object) -> tuple[str, str] | None:
    """(name, arguments JSON) of a {"name", "arguments" or "parameters"} object, else None;
    its arguments are those of the first of the two keys it has ({} when neither)."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = next((v for k, v in item.items() if k in ("arguments", "parameters")), {})
    if isinstance(arguments, str):
        return item["name"], arguments
    if not isinstance(arguments, dict):
        return None
    return item["name"], json.dumps(arguments, ensure_ascii=False)
