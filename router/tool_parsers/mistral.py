"""tool_call_parser "mistral": Mistral's instruct models write text, then [TOOL_CALLS] and
their calls, in one of two forms, told apart by what follows the marker (whitespace
aside): a [ begins the array form, anything else the named form.

    [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]    7B v0.3, Nemo, Small (the
                                                            format vLLM's mistral parser
                                                            reads with an HF tokenizer)
    [TOOL_CALLS]f{...}  or  [TOOL_CALLS]f[ARGS]{...}        v11+ tokenizers: Small 3.1 /
    or  [TOOL_CALLS]f[CALL_ID]a1B2c3D4e[ARGS]{...}          3.2, Magistral, Devstral; one
                                                            [TOOL_CALLS] per call

[TOOL_CALLS] is a special token, so "auto" requests with this parser keep special tokens
in their text, as vLLM's do (`router.tools.ToolPlan.keeps_special_tokens`).

Text before [TOOL_CALLS] is content; each element of the array streams as a call as it
arrives (`router.tool_parsers.json_call`): its name once read, then its arguments as
written; after the array the text is content again (another [TOOL_CALLS] begins another
array). An element that is no call of a tool a call may name (an unknown name, a second
call without parallel_tool_calls), text after [TOOL_CALLS] that is no array of objects,
an element broken after its call was sent, or an array the end cut is content from where
the last call's text ended ([TOOL_CALLS] included when none was sent), and the rest is
read as text: nothing is dropped. A named call streams the same way, and breaks the same
way (`router.tool_parsers.mistral_named`); after its arguments the text is content
again, and the next [TOOL_CALLS] begins the next call. Call ids are 9 letters and
digits, as Mistral's chat templates require of the ids they are sent: the id a named call
wrote after [CALL_ID] when it is such (and no earlier call's of the choice), as
mistral-common reads it, else a fresh one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router.call_ids import CallIds
from router.reasoning import tag_tail
from router.tool_calls import AutoCalls, Text, content
from router.tool_parsers.json_call import JsonCall
from router.tool_parsers.mistral_named import MARKER, WHITESPACE, NamedCall


@dataclass
class Array:
    """The array after a [TOOL_CALLS]. `text`: from the marker on; text[:frontier] is
    read into calls sent (or is the marker, while frontier is 0)."""

    text: Text = field(default_factory=lambda: Text(MARKER))
    at: int = len(MARKER)
    """text[:at] is read."""
    opened: bool = False
    """Its [ was read."""
    frontier: int = 0
    element: JsonCall | None = None
    start: int = -1
    """Where the open element begins."""


@dataclass
class MistralCalls(AutoCalls):
    """[TOOL_CALLS] arrays read into calls (module docstring); text outside them is
    content (a tail that may begin [TOOL_CALLS] is held until it is known)."""

    held: str = ""
    after: Text | None = None
    """The text after a [TOOL_CALLS] while its form is unknown (only whitespace)."""
    array: Array | None = None
    named: NamedCall | None = None
    ids: CallIds = field(default_factory=lambda: CallIds(mistral=True))
    """Mistral's ids: the id the model wrote is the call's when it is 9 letters and
    digits and no earlier call's; else the call gets a fresh one."""

    def feed(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            if self.array is not None:
                text = self._read(text, out)
                if self.array is not None:
                    return out
                continue  # the array ended: text is what follows it
            if self.named is not None:
                rest = self.named.read(self, text, out)
                if rest is None:
                    return out
                text, self.named = rest, None
                continue
            if self.after is not None:
                if not self._form(text):
                    return out
                text, self.after = str(self.after), None
                continue
            self.held += text
            opened = self.held.find(MARKER)
            if opened < 0:
                keep = tag_tail(self.held, MARKER)
                out += content(self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                return out
            out += content(self.held[:opened])
            text, self.held = self.held[opened + len(MARKER) :], ""
            self.after = Text()

    def _form(self, text: str) -> bool:
        """Text after a [TOOL_CALLS]: whether its form is known (by what follows the
        whitespace, [ for an array, else a name), the reader of that form then made."""
        assert self.after is not None
        self.after += text
        rest = text.lstrip(WHITESPACE)  # what came before is whitespace
        if not rest:
            return False
        if rest[0] == "[":
            self.array = Array()
        else:
            self.named = NamedCall()
        return True

    def end(self) -> list[dict[str, Any]]:
        held, self.held = self.held, ""
        if self.named is not None:
            named, self.named = self.named, None
            return named.end(self)
        if self.after is not None:
            after, self.after = self.after, None
            return content(MARKER + str(after))
        if self.array is None:
            return content(held)
        a, self.array = self.array, None
        if a.element is not None and a.element.index >= 0:
            a.frontier = a.start + a.element.frontier
        return content(a.text[a.frontier :])  # an array the end cut

    def _read(self, text: str, out: list[dict[str, Any]]) -> str:
        """Reads text into the open array, its calls into out; once the array ended (or
        broke), the text after it, to read as text."""
        a = self.array
        assert a is not None
        base = len(a.text)  # a.text[:a.at] is read: all but the new text
        a.text += text
        while a.at < base + len(text):
            if a.element is not None:
                deltas, took = a.element.read(self, text[a.at - base :])
                out += deltas
                a.at += took
                if a.element.stage != "done":
                    return ""
                if not self._element(a, a.element, out):
                    return self._broken(a.at, out)
                continue
            ch = text[a.at - base]
            if ch == "{" and a.opened:
                a.element, a.start = JsonCall(), a.at
                continue
            if ch == "]" and a.opened:
                self.array = None
                if not a.frontier:  # no call: [TOOL_CALLS][] is text
                    out += content(a.text[: a.at + 1])
                return a.text[a.at + 1 :]
            if ch == "[" and not a.opened:
                a.opened = True
            elif not (ch in WHITESPACE or (ch == "," and a.opened)):
                return self._broken(a.at, out)
            a.at += 1
        return ""

    def _element(self, a: Array, element: JsonCall, out: list[dict[str, Any]]) -> bool:
        """The element ended (at a.at): whether it was a call; else the array breaks at
        its end, after its call's text where one was sent."""
        a.element = None
        first = element.ended(self)
        if first is None:
            if element.index >= 0:
                a.frontier = a.start + element.frontier
            return False
        out += first
        a.frontier = a.at
        return True

    def _broken(self, at: int, out: list[dict[str, Any]]) -> str:
        """The array breaks at `at`: what it held since the last call is content; the
        text from `at` on is read as text."""
        a, self.array = self.array, None
        assert a is not None
        out += content(a.text[a.frontier : at])
        return a.text[at:]
