"""The call form of Mistral's v11+ tokenizers (Mistral Small 3.1 / 3.2, Magistral,
Devstral), one [TOOL_CALLS] per call, as mistral-common's tokenizers write and read it:

    [TOOL_CALLS]get_weather{"city": "Oslo"}
    [TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}
    [TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Oslo"}

read as it arrives (`NamedCall`, from its [TOOL_CALLS] on; whitespace may lead the name):

    get_weather              while it begins the name of a tool a call may name
    [CALL_ID]a1B2c3D4e       the call's id, letters and digits (`MistralCalls.start_call`
                             keeps it as the call's id, or gives a fresh one)
    { or [ARGS]              the name (and id) ended, naming such a tool: the call's first
                             delta (index, id, name, arguments "")
    {...}                    the arguments' JSON text, as written, as it arrives; the
                             bracket that closes the first ends them, and the call

A name that is no name of a tool a call may name (an unknown name, a second call without
parallel_tool_calls, no name) breaks the call where that is known (its first character
that begins no such name, or the { or [ after it), and so does an id that is not letters
and digits up to [ARGS]: the text from [TOOL_CALLS] up to there is content, the rest is
read as text. Whitespace between [ARGS] and { is neither. Once the call was sent nothing
takes it back: after [ARGS], text that is no { (whitespace aside) is content from
[ARGS]'s end on; arguments the end cut end as written (invalid JSON included). A call the
end cut before its arguments began (right after its name, its id or [ARGS]) has the
arguments {}, as vLLM's mistral parser reads a bare `[TOOL_CALLS]now` whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router.tool_calls import AutoCalls, JsonScan, Text, arguments_delta, content
from router.tool_parsers.json_call import WHITESPACE

MARKER = "[TOOL_CALLS]"
ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"


@dataclass
class NamedCall:
    """One call from its [TOOL_CALLS] on. `text`: from the marker on; text[:frontier] is
    read into the call sent (0: none sent yet)."""

    text: Text = field(default_factory=lambda: Text(MARKER))
    at: int = len(MARKER)
    """text[:at] is read."""
    stage: str = "space"
    """"space" (before the name), "name", "marker" (reading [ARGS] or [CALL_ID]), "id"
    (after [CALL_ID]), "gap" (after [ARGS], before the arguments' {), "arguments"
    (streaming them)."""
    name_start: int = -1
    name_end: int = -1
    marker_start: int = -1
    """Where the marker being read begins."""
    id_start: int = -1
    """Where the id begins, after [CALL_ID] (-1: none)."""
    call_id: str = ""
    index: int = -1
    """The call's index once its first delta was sent."""
    frontier: int = 0
    scan: JsonScan = field(default_factory=JsonScan)

    def read(self, calls: AutoCalls, text: str, out: list[dict[str, Any]]) -> str | None:
        """Reads text on, its deltas into out: None while the call is open; once it ended
        (or broke), the text after it, to read as text."""
        base = len(self.text)  # text[:at] is read: all but the new text
        self.text += text
        while self.at < base + len(text):
            ch = text[self.at - base]
            if self.stage == "arguments":
                self.at += 1
                if self.scan.step(ch) and self.scan.depth == 0:
                    self._send(out, text, base)
                    return text[self.at - base :]
            elif self.stage == "space" and ch in WHITESPACE:
                self.at += 1
            elif self.stage in ("space", "name"):
                if not self._name(calls, ch, out):
                    return self._broken(out)
            elif self.stage == "marker":
                if not self._marker(calls, out):
                    self.at = self.marker_start
                    return self._broken(out)
            elif self.stage == "id":
                if not self._id(ch):
                    return self._broken(out)
            elif ch == "{":  # after [ARGS] (and whitespace, which is neither)
                self.stage, self.frontier = "arguments", self.at
            elif ch in WHITESPACE:
                self.at += 1
            else:
                return self._broken(out)
        if self.stage == "arguments":
            self._send(out, text, base)
        return None

    def end(self, calls: AutoCalls) -> list[dict[str, Any]]:
        """The text ended: a call cut before its arguments began, with arguments {}; else
        what of the text was no call (all of it, when none was sent)."""
        if self.stage == "name" and calls.may_call(self.text[self.name_start : self.at]):
            self.name_end = self.at
            return [self._start(calls, "{}")]
        if self.stage == "id":
            self.call_id = self.text[self.id_start : self.at]
            return [self._start(calls, "{}")]
        if self.stage == "gap":
            return [arguments_delta(self.index, "{}")]
        return content(self.text[self.frontier :])

    def _name(self, calls: AutoCalls, ch: str, out: list[dict[str, Any]]) -> bool:
        """One character of the name, or the { or [ that ends it: whether it reads on."""
        if self.stage == "space":
            self.stage, self.name_start = "name", self.at
        name = self.text[self.name_start : self.at]
        if ch in "{[":
            if not calls.may_call(name):
                return False
            self.name_end = self.at
            if ch == "{":
                out.append(self._start(calls, ""))
                self.stage = "arguments"
            else:
                self.stage, self.marker_start = "marker", self.at
                self.at += 1
            return True
        prefix = name + ch
        if not any(n.startswith(prefix) and calls.may_call(n) for n in calls.names):
            return False
        self.at += 1
        return True

    def _marker(self, calls: AutoCalls, out: list[dict[str, Any]]) -> bool:
        """One more character of the marker after the name ([ARGS] or [CALL_ID]) or after
        the id ([ARGS]): whether it reads on."""
        read = self.text[self.marker_start : self.at + 1]
        markers = (ARGS,) if self.id_start >= 0 else (ARGS, CALL_ID)
        if not any(marker.startswith(read) for marker in markers):
            return False
        self.at += 1
        if read == ARGS:
            out.append(self._start(calls, ""))
            self.stage = "gap"
        elif read == CALL_ID:
            self.stage, self.id_start = "id", self.at
        return True

    def _id(self, ch: str) -> bool:
        """One character of the id, or the [ that ends it: whether it reads on."""
        if ch == "[":
            self.call_id = self.text[self.id_start : self.at]
            self.stage, self.marker_start = "marker", self.at
        elif not (ch.isascii() and ch.isalnum()):
            return False
        self.at += 1
        return True

    def _start(self, calls: AutoCalls, arguments: str) -> dict[str, Any]:
        """The name (and id) ended: the call's first delta."""
        name = self.text[self.name_start : self.name_end]
        first = calls.start_call(name, arguments, self.call_id)
        self.index = calls.calls - 1
        self.frontier = self.at
        return first

    def _send(self, out: list[dict[str, Any]], text: str, base: int) -> None:
        """The arguments read since the last delta: in `text`, what this read took on
        from `base` (each read ends sending, so frontier is not before base)."""
        if self.at > self.frontier:
            out.append(arguments_delta(self.index, text[self.frontier - base : self.at - base]))
            self.frontier = self.at

    def _broken(self, out: list[dict[str, Any]]) -> str:
        """The call breaks at `at`: what it held since its call's text is content; the
        text from `at` on is read as text."""
        out += content(self.text[self.frontier : self.at])
        return self.text[self.at :]
