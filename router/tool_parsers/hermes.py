"""tool_call_parser "hermes": text, then any number of
<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks, as Hermes, Qwen 2.5 / 3
and the demo's template write them. A call streams as it is generated, as vLLM's hermes
parser streams it:

    {"name": "f"            the name's string closed, naming a tool a call may name:
                            the call's first delta (index, id, name, arguments "")
    , "arguments": {...     the arguments object's JSON text, as written, as it arrives
    }                       (its close ends the arguments)
    }</tool_call>           nothing more

A block that names no tool a call may name (an unknown name, a second call without
parallel_tool_calls), that is no JSON object, or whose "arguments" come before its
"name", is read whole at its end as it always was: a call if it reads as one, else
content, tags and all. Once a call was sent, what its block holds besides the call is
not dropped: arguments cut (by </tool_call>, a length cut, EOS) end as written; text
after the object, or an object that breaks before its arguments, is content from where
the call's text ends; arguments that are no object (a JSON string) are sent whole at the
block's end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from router.reasoning import tag_tail
from router.tool_calls import AutoCalls, JsonScan, arguments_delta, call_of, content

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")
WHITESPACE = " \t\r\n"


@dataclass
class Block:
    """What is read of the open <tool_call> block. `body`: its text so far (none of it
    part of a </tool_call>); indexes below are into it (-1: not yet)."""

    body: str = ""
    scan: JsonScan = field(default_factory=JsonScan)
    stage: str = "head"
    """"head" (members up to the arguments' value), "arguments" (streaming them), "tail"
    (after them, up to the object's close), "after" (after the object), "whole" (to be
    read whole at the block's end: no call was sent)."""
    expect: str = "object"
    """In "head": "object", "key", "key string", "colon", "value", "name string", or
    "skip" (a value read past, up to the next "," or the object's close)."""
    key: object = None
    string_start: int = -1
    index: int = -1
    """The call's index once its first delta was sent."""
    name_end: int = -1
    arguments_start: int = -1
    arguments_end: int = -1
    object_end: int = -1
    sent: int = -1
    """body[arguments_start:sent] was sent as arguments."""


@dataclass
class HermesCalls(AutoCalls):
    """Hermes blocks read into calls (module docstring); text outside them is content (a
    tail that may begin a tag is held until it is known)."""

    held: str = ""
    block: Block | None = None

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.held += text
        out: list[dict[str, Any]] = []
        while True:
            if self.block is not None:
                close = self.held.find(CLOSE)
                settled = close if close >= 0 else len(self.held) - tag_tail(self.held, CLOSE)
                out += self._read(self.held[:settled])
                if close < 0:
                    self.held = self.held[settled:]
                    return out
                out += self._finish(closed=True)
                self.held = self.held[close + len(CLOSE) :]
                continue
            opened = self.held.find(OPEN)
            if opened < 0:
                keep = tag_tail(self.held, OPEN)
                out += content(self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                return out
            out += content(self.held[:opened])
            self.held = self.held[opened + len(OPEN) :]
            self.block = Block()

    def end(self) -> list[dict[str, Any]]:
        held, self.held = self.held, ""
        if self.block is None:
            return content(held)
        return self._read(held) + self._finish(closed=False)  # a block the end cut

    def _read(self, text: str) -> list[dict[str, Any]]:
        """Reads more of the open block's body: the call's first delta once its name is
        known, the arguments' text that arrived."""
        b = self.block
        assert b is not None
        out: list[dict[str, Any]] = []
        base = len(b.body)
        b.body += text
        for i in range(base, len(b.body)):
            if b.stage in ("after", "whole"):
                break
            ch = b.body[i]
            structure = b.scan.step(ch)
            if b.stage == "head":
                out += self._head(b, i, ch, structure)
            elif structure and b.scan.depth == 1 and b.stage == "arguments":
                b.stage, b.arguments_end = "tail", i + 1
            elif structure and b.scan.depth == 0 and b.stage == "tail":
                b.stage, b.object_end = "after", i + 1
        if b.sent >= 0:
            upto = b.arguments_end if b.arguments_end >= 0 else len(b.body)
            if upto > b.sent:
                out.append(arguments_delta(b.index, b.body[b.sent : upto]))
                b.sent = upto
        return out

    def _head(self, b: Block, i: int, ch: str, structure: bool) -> list[dict[str, Any]]:
        """One character of the object's members before the arguments' value."""
        if b.expect == "skip":
            if structure and ch == "," and b.scan.depth == 1:
                b.expect = "key"
            elif structure and b.scan.depth == 0:
                self._object_closed(b, i)
            return []
        if b.expect in ("key string", "name string"):
            if b.scan.in_string:
                return []
            return self._string_read(b, i + 1)
        if ch in WHITESPACE:
            return []
        if b.expect == "object" and ch == "{":
            b.expect = "key"
        elif b.expect == "key" and ch == '"':
            b.expect, b.string_start = "key string", i
        elif b.expect == "key" and ch == "}":
            self._object_closed(b, i)
        elif b.expect == "colon" and ch == ":":
            b.expect = "value"
        elif b.expect == "value":
            self._value(b, i, ch)
        else:
            self._broken(b)
        return []

    def _string_read(self, b: Block, end: int) -> list[dict[str, Any]]:
        """A key's or the name's string closed (at end): the call's first delta when it
        is a name a call may have."""
        try:
            text = json.loads(b.body[b.string_start : end])
        except ValueError:
            self._broken(b)
            return []
        if b.expect == "key string":
            b.key, b.expect = text, "colon"
            return []
        b.expect = "skip"
        if not self.may_call(text):
            b.stage = "whole"
            return []
        b.name_end = end
        first = self._call(text, "")
        b.index = self.calls - 1
        return [first]

    def _value(self, b: Block, i: int, ch: str) -> None:
        """The first character of a member's value."""
        b.expect = "skip"
        if b.key == "name" and b.index < 0:
            if ch == '"':
                b.expect, b.string_start = "name string", i
            else:
                b.stage = "whole"
        elif b.key in ARGUMENT_KEYS and b.index < 0:
            b.stage = "whole"  # arguments before the name: read whole at the end
        elif b.key in ARGUMENT_KEYS and ch == "{":
            b.stage, b.arguments_start, b.sent = "arguments", i, i

    def _object_closed(self, b: Block, i: int) -> None:
        b.stage, b.object_end = ("after", i + 1) if b.index >= 0 else ("whole", -1)

    def _broken(self, b: Block) -> None:
        """The object breaks in its head: the call, if sent, ends at its block's end."""
        b.stage = "after" if b.index >= 0 else "whole"

    def _finish(self, closed: bool) -> list[dict[str, Any]]:
        """The block's end (closed: by </tool_call>, else by the end of the text)."""
        b, self.block = self.block, None
        assert b is not None
        close = CLOSE if closed else ""
        if b.index < 0:
            return self._whole(b.body, OPEN + b.body + close)
        if b.arguments_start >= 0:
            rest = b.body[max(b.object_end, b.arguments_end, b.sent) :]
            return content(rest + close) if rest.strip() else []
        call = hermes_call(b.body)
        if call is not None:  # arguments that are no object, or none (then {})
            return [arguments_delta(b.index, call[1])] if call[1] else []
        rest = b.body[b.name_end :]
        return content(rest + close) if rest.strip() else []

    def _whole(self, body: str, raw: str) -> list[dict[str, Any]]:
        call = hermes_call(body)
        if call is None or not self.may_call(call[0]):
            return content(raw)
        return [self._call(*call)]


def hermes_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a block's {"name", "arguments"} object, else None."""
    try:
        item = json.loads(body)
    except ValueError:
        return None
    return call_of(item)
