"""tool_call_parser "llama3_json": Llama 3.1 / 3.2 write a call answer as one or more
{"name": ..., "parameters": {...}} objects ("arguments" too) separated by ";" (and
whitespace), optionally after <|python_tag|>; any other answer is text. Each call
streams as its object arrives (`router.tool_parsers.json_call`): its name once read,
then its arguments as written.

An answer that begins with `{` (or <|python_tag|>) is held until its first object tells:
one that is no call of a tool a call may name (not JSON, an unknown name, no name) makes
the whole answer content, as it came. Once a call was sent, what breaks the answer (an
object that is no call of such a tool, a second call without parallel_tool_calls, text
after the calls, an object broken after its name) is content from where the last call's
text ended to the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.tool_calls import AnswerCalls
from router.tool_parsers.json_call import JsonCall

PYTHON_TAG = "<|python_tag|>"
SEPARATORS = " \t\r\n;"


@dataclass
class Llama3Calls(AnswerCalls):
    """An answer that begins with `{` (or <|python_tag|>) is ";"-separated call objects."""

    starts: tuple[str, ...] = ("{", PYTHON_TAG)
    at: int = 0
    """answer[:at] is read (0: not even its lead, the whitespace and <|python_tag|>)."""
    frontier: int = 0
    """Where the last call's text ends in answer (0: no call yet)."""
    call: JsonCall | None = None
    call_start: int = -1

    def read(self, text: str) -> list[dict[str, Any]]:
        base = len(self.answer) - len(text)  # text is answer[base:], and at >= base
        if self.at == 0:
            tag = self.answer.startswith(PYTHON_TAG, self.lead)
            self.at = self.lead + (len(PYTHON_TAG) if tag else 0)
        out: list[dict[str, Any]] = []
        while self.calls_answer:
            if self.call is not None:
                deltas, took = self.call.read(self, text[self.at - base :])
                out += deltas
                self.at += took
                if self.call.broke:
                    return out + self.give_up(self.frontier)
                if self.call.stage != "done":
                    return out
                out += self._object_end(self.call)
                self.call = None
            elif self.at == base + len(text):
                return out
            elif text[self.at - base] == "{":
                self.call, self.call_start = JsonCall(), self.at
            elif text[self.at - base] in SEPARATORS:
                self.at += 1
            else:
                return out + self.give_up(self.frontier)
        return out

    def _object_end(self, call: JsonCall) -> list[dict[str, Any]]:
        """An object ended (at self.at): a call, else the answer breaks."""
        first = call.ended(self)
        if first is None:
            sent = call.index >= 0
            return self.give_up(self.call_start + call.frontier if sent else self.frontier)
        self.frontier = self.at
        return first

    def read_end(self) -> list[dict[str, Any]]:
        if self.call is not None and self.call.index >= 0:  # a sent call the end cut
            at = self.call_start + self.call.frontier
            return self.give_up(at) if self.answer[at:].strip() else []
        if self.call is not None or not self.calls:
            return self.give_up(self.frontier)  # a cut object, or no call at all
        return []  # only separators after the last call
