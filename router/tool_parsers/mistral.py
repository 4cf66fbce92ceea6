"""tool_call_parser "mistral": Mistral's instruct models (7B v0.3, Nemo, Small; the format
vLLM's mistral parser reads with an HF tokenizer) write text, then [TOOL_CALLS] and a
JSON array of {"name": ..., "arguments": {...}} objects. [TOOL_CALLS] is a special token,
so "auto" requests with this parser keep special tokens in their text, as vLLM's do
(`router.tools.ToolPlan.keeps_special_tokens`).

Text before [TOOL_CALLS] is content; each element of the array is sent as a call once it
closes; after the array the text is content again (another [TOOL_CALLS] begins another
array). An element that is no call of a tool a call may name (an unknown name, a second
call without parallel_tool_calls), text after [TOOL_CALLS] that is no array of objects,
or an array the end cut is content from where the last call's text ended ([TOOL_CALLS]
included when none was sent), and the rest is read as text: nothing is dropped. Call ids
are 9 letters and digits, as Mistral's chat templates require of the ids they are sent.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from router.reasoning import tag_tail
from router.tool_calls import AutoCalls, JsonScan, call_of, content

MARKER = "[TOOL_CALLS]"
WHITESPACE = " \t\r\n"


@dataclass
class Array:
    """The array after a [TOOL_CALLS]. `text`: from the marker on; text[:frontier] is
    read into calls sent (or is the marker, while frontier is 0)."""

    text: str = MARKER
    scan: JsonScan = field(default_factory=JsonScan)
    frontier: int = 0
    start: int = -1
    """Where the open element begins (-1: none open)."""


@dataclass
class MistralCalls(AutoCalls):
    """[TOOL_CALLS] arrays read into calls (module docstring); text outside them is
    content (a tail that may begin [TOOL_CALLS] is held until it is known)."""

    held: str = ""
    array: Array | None = None

    def new_id(self) -> str:
        return uuid.uuid4().hex[:9]

    def feed(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            if self.array is not None:
                text = self._read(text, out)
                if self.array is not None:
                    return out
                continue  # the array ended: text is what follows it
            self.held += text
            opened = self.held.find(MARKER)
            if opened < 0:
                keep = tag_tail(self.held, MARKER)
                out += content(self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                return out
            out += content(self.held[:opened])
            text, self.held = self.held[opened + len(MARKER) :], ""
            self.array = Array()

    def end(self) -> list[dict[str, Any]]:
        held, self.held = self.held, ""
        if self.array is None:
            return content(held)
        a, self.array = self.array, None
        return content(a.text[a.frontier :])  # an array the end cut

    def _read(self, text: str, out: list[dict[str, Any]]) -> str:
        """Reads text into the open array, its calls into out; once the array ended (or
        broke), the text after it, to read as text."""
        a = self.array
        assert a is not None
        base = len(a.text)
        a.text += text
        for i in range(base, len(a.text)):
            ch = a.text[i]
            structure = a.scan.step(ch)
            depth = a.scan.depth
            if a.start >= 0:  # inside an element
                if structure and ch == "}" and depth == 1:
                    if not self._element(a, i + 1, out):
                        return self._broken(i + 1, out)
                elif depth < 2:
                    return self._broken(i, out)
            elif not structure:
                return self._broken(i, out)  # a string outside the elements
            elif ch == "{" and depth == 2:
                a.start = i
            elif ch == "]" and depth == 0:
                self.array = None
                if not a.frontier:  # no call: [TOOL_CALLS][] is text
                    out += content(a.text[: i + 1])
                return a.text[i + 1 :]
            elif not (ch in WHITESPACE or (ch in "[," and depth == 1)):
                return self._broken(i, out)
        return ""

    def _element(self, a: Array, end: int, out: list[dict[str, Any]]) -> bool:
        """The element a.text[a.start:end] closed: sent if a call a call may be."""
        try:
            call = call_of(json.loads(a.text[a.start : end]))
        except ValueError:
            return False
        if call is None or not self.may_call(call[0]):
            return False
        out.append(self.start_call(*call))
        a.frontier, a.start = end, -1
        return True

    def _broken(self, at: int, out: list[dict[str, Any]]) -> str:
        """The array breaks at `at`: what it held since the last call is content; the
        text from `at` on is read as text."""
        a, self.array = self.array, None
        assert a is not None
        out += content(a.text[a.frontier : at])
        return a.text[at:]
