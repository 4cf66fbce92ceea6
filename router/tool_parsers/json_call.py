"""One {"name": ..., "arguments" or "parameters": {...}} call object read as it arrives, the
way vLLM's parsers stream a call (hermes' blocks, llama3_json's answers and mistral's
array elements are each such objects; their parsers find where one begins):

    {"name": "f"            the name's string closed, naming a tool a call may name:
                            the call's first delta (index, id, name, arguments "")
    , "arguments": {...     the arguments object's JSON text, as written, as it arrives
    }                       (its close ends the arguments)
    }                       the object's end (a ] there breaks it instead)

An object that names no tool a call may name (an unknown name, a second call without
parallel_tool_calls), that is no JSON object, or whose arguments come before its name is
read whole at its end (`whole_call`), by the parser that holds it. Of an object's
duplicate members the first is the call's, read as it arrives or whole alike: its first
"name", and its first "arguments" or "parameters" (a sent name cannot be taken back;
json.loads would keep the last). Once a call was sent nothing takes it back: its
arguments end as written (cut by the end, invalid JSON included), arguments that are no
object (a JSON string) are sent whole at the object's end, and where the object breaks
(or its arguments are neither) the call's text ends (`JsonCall.frontier`): its parser
makes what follows content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from router.tool_calls import AutoCalls, JsonScan, Text, arguments_delta, call_of

ARGUMENT_KEYS = ("arguments", "parameters")
WHITESPACE = " \t\r\n"
Delta = dict[str, Any]


@dataclass
class JsonCall:
    """The object read so far. `body`: its text, from the first character it was given
    (whitespace may lead) to where it ended; indexes below are into it (-1: not yet)."""

    body: Text = field(default_factory=Text)
    scan: JsonScan = field(default_factory=JsonScan)
    stage: str = "head"
    """"head" (its members, but for the arguments' value), "arguments" (streaming them),
    "whole" (no call was sent: scanned to its end, to be read whole), "done" (ended)."""
    expect: str = "object"
    """In "head": "object", "key", "key string", "colon", "value", "name string", or
    "skip" (a value read past, up to the next "," or the object's close)."""
    key: object = None
    string_start: int = -1
    index: int = -1
    """The call's index once its first delta was sent."""
    name_end: int = -1
    arguments_seen: bool = False
    """The value of its first "arguments" or "parameters" member began (later ones are
    skipped: the first is the call's)."""
    arguments_start: int = -1
    arguments_end: int = -1
    sent: int = -1
    """body[arguments_start:sent] was sent as arguments."""
    end: int = -1
    """Where its text ended: after its closing }, or at the character that broke it."""
    closed: bool = False
    """It ended with its closing } (else it broke, or is open)."""
    clean: bool = False
    """It closed, all of it read into the call sent (else the call's text ends earlier)."""
    broke: bool = False
    """Its head broke before a call was sent: it is no JSON object."""

    @property
    def frontier(self) -> int:
        """Where the sent call's text ends in body (0: no call was sent)."""
        if self.index < 0:
            return 0
        if self.clean:
            return self.end
        return self.sent if self.arguments_start >= 0 else self.name_end

    def ended(self, calls: AutoCalls) -> list[Delta] | None:
        """Once done: what more its call is ([] when all of it was sent; the call, when
        read whole), or None when its text from `frontier` on is no call."""
        if self.index >= 0:
            return [] if self.clean else None
        return whole_call(calls, str(self.body)) if self.closed else None

    def read(self, calls: AutoCalls, text: str) -> tuple[list[Delta], int]:
        """Reads text on into the object: the call's deltas it tells, and how much of text
        the object took (all of it, unless it ended in text)."""
        out: list[Delta] = []
        base = len(self.body)
        length = base + len(text)
        self.body += text
        for i, ch in enumerate(text, base):
            structure = self.scan.step(ch)
            if self.stage == "arguments":
                if structure and self.scan.depth == 1:
                    self.stage, self.expect, self.arguments_end = "head", "skip", i + 1
            elif structure and self.scan.depth == 0 and self.expect != "object":
                out += self._ended(calls, i, ch)
            elif self.stage == "head":
                out += self._head(calls, i, ch, structure)
            if self.stage == "done":
                self.body, length = Text(self.body[: self.end]), self.end
                break
        if self.sent >= 0:
            upto = self.arguments_end if self.arguments_end >= 0 else length
            if upto > self.sent:  # then sent >= base: text holds what is to send
                out.append(arguments_delta(self.index, text[self.sent - base : upto - base]))
                self.sent = upto
        return out, length - base

    def _head(self, calls: AutoCalls, i: int, ch: str, structure: bool) -> list[Delta]:
        """One character of the object's members (but the arguments' value), before
        its close."""
        if self.expect == "skip":
            if structure and ch == "," and self.scan.depth == 1:
                self.expect = "key"
            return []
        if self.expect in ("key string", "name string"):
            if self.scan.in_string:
                return []
            return self._string_read(calls, i + 1)
        if ch in WHITESPACE:
            return []
        if self.expect == "object" and ch == "{":
            self.expect = "key"
        elif self.expect == "key" and ch == '"':
            self.expect, self.string_start = "key string", i
        elif self.expect == "colon" and ch == ":":
            self.expect = "value"
        elif self.expect == "value":
            self._value(i, ch)
        else:
            self._broken(i)
        return []

    def _string_read(self, calls: AutoCalls, end: int) -> list[Delta]:
        """A key's or the name's string closed (at end): the call's first delta when it
        is a name a call may have."""
        try:
            text = json.loads(self.body[self.string_start : end])
        except ValueError:
            self._broken(end - 1)
            return []
        if self.expect == "key string":
            self.key, self.expect = text, "colon"
            return []
        self.expect = "skip"
        if not calls.may_call(text):
            self.stage = "whole"
            return []
        self.name_end = end
        first = calls.start_call(text, "")
        self.index = calls.calls - 1
        return [first]

    def _value(self, i: int, ch: str) -> None:
        """The first character of a member's value."""
        self.expect = "skip"
        if self.key == "name" and self.index < 0:
            if ch == '"':
                self.expect, self.string_start = "name string", i
            else:
                self.stage = "whole"
        elif self.key in ARGUMENT_KEYS and self.index < 0:
            self.stage = "whole"  # arguments before the name: read whole at the end
        elif self.key in ARGUMENT_KEYS and not self.arguments_seen:
            self.arguments_seen = True
            if ch == "{":
                self.stage, self.arguments_start, self.sent = "arguments", i, i

    def _ended(self, calls: AutoCalls, i: int, ch: str) -> list[Delta]:
        """The object's outermost bracket closed at i: by } its end (a sent call's
        arguments that were no object are sent now, read from the whole object), by ]
        a break."""
        if ch != "}":
            self.stage, self.end = "done", i
            return []
        self.stage, self.end, self.closed = "done", i + 1, True
        if self.index < 0:
            return []
        self.clean = self.arguments_start >= 0
        if self.clean:
            return []
        call = whole_object(self.body[: i + 1])
        if call is None:
            return []
        self.clean = True
        return [arguments_delta(self.index, call[1])] if call[1] else []

    def _broken(self, i: int) -> None:
        """The head breaks at i: a sent call's text ends; else the object is read whole."""
        if self.index >= 0:
            self.stage, self.end = "done", i
        else:
            self.stage, self.broke = "whole", True


def whole_object(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a whole {"name", "arguments"} object's text, else None.
    Of its duplicate members the first is the call's, as `JsonCall` streams it:
    '{"name": "f", "name": "g"}' -> ("f", "{}"); nested values keep json's last."""
    outermost: list[list[tuple[str, Any]]] = []

    def members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        outermost[:] = [pairs]  # the outermost object's members are decoded last
        return dict(pairs)

    try:
        item = json.loads(text, object_pairs_hook=members)
    except (ValueError, RecursionError):  # no JSON, or nested deeper than json decodes
        return None
    if not isinstance(item, dict):
        return None
    first: dict[str, Any] = {}
    for key, value in outermost[0]:
        first.setdefault(key, value)
    return call_of(first)


def whole_call(calls: AutoCalls, text: str) -> list[Delta] | None:
    """The call of an object read whole, when it is one of a tool a call may name."""
    call = whole_object(text)
    if call is None or not calls.may_call(call[0]):
        return None
    return [calls.start_call(*call)]
