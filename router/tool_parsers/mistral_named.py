"""The call form of Mistral's v11+ tokenizers (Mistral Small 3.1 / 3.2, Magistral,
Devstral), one [TOOL_CALLS] per call, as vLLM's mistral parser reads it:

    [TOOL_CALLS]get_weather{"city": "Oslo"}
    [TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}

read as it arrives (`NamedCall`, from its [TOOL_CALLS] on; whitespace may lead the name):

    get_weather              while it begins the name of a tool a call may name
    { or [ARGS]              the name ended, naming such a tool: the call's first delta
                             (index, id, name, arguments "")
    {...}                    the arguments' JSON text, as written, as it arrives; the
                             bracket that closes the first ends them, and the call

A name that is no name of a tool a call may name (an unknown name, a second call without
parallel_tool_calls, no name) breaks the call where that is known (its first character
that begins no such name, or the { or [ after it): the text from [TOOL_CALLS] up to
there is content, the rest is read as text. Whitespace between [ARGS] and { is neither. Once the call was sent
nothing takes it back: after [ARGS], text that is no { (whitespace aside) is content
from [ARGS]'s end on; arguments the end cut end as written (invalid JSON included).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router.tool_calls import AutoCalls, JsonScan, arguments_delta, content
from router.tool_parsers.json_call import WHITESPACE

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"


@dataclass
class NamedCall:
    """One call from its [TOOL_CALLS] on. `text`: from the marker on; text[:frontier] is
    read into the call sent (0: none sent yet)."""

    text: str = MARKER
    at: int = len(MARKER)
    """text[:at] is read."""
    stage: str = "space"
    """"space" (before the name), "name", "args" (reading [ARGS]), "gap" (after [ARGS],
    before the arguments' {), "arguments" (streaming them)."""
    name_start: int = -1
    args_start: int = -1
    """Where [ARGS] begins."""
    index: int = -1
    """The call's index once its first delta was sent."""
    frontier: int = 0
    scan: JsonScan = field(default_factory=JsonScan)

    def read(self, calls: AutoCalls, text: str, out: list[dict[str, Any]]) -> str | None:
        """Reads text on, its deltas into out: None while the call is open; once it ended
        (or broke), the text after it, to read as text."""
        self.text += text
        while self.at < len(self.text):
            ch = self.text[self.at]
            if self.stage == "arguments":
                self.at += 1
                if self.scan.step(ch) and self.scan.depth == 0:
                    self._send(out)
                    return self.text[self.at :]
            elif self.stage == "space" and ch in WHITESPACE:
                self.at += 1
            elif self.stage in ("space", "name"):
                if not self._name(calls, ch, out):
                    return self._broken(out)
            elif self.stage == "args":
                if not ARGS.startswith(self.text[self.args_start : self.at + 1]):
                    self.at = self.args_start
                    return self._broken(out)
                self.at += 1
                if self.at - self.args_start == len(ARGS):
                    self._start(calls, out)
                    self.stage = "gap"
            elif ch == "{":  # after [ARGS] (and whitespace, which is neither)
                self.stage, self.frontier = "arguments", self.at
            elif ch in WHITESPACE:
                self.at += 1
            else:
                return self._broken(out)
        if self.stage == "arguments":
            self._send(out)
        return None

    def end(self) -> list[dict[str, Any]]:
        """The text ended: what of it was no call (all of it, when none was sent)."""
        return content(self.text[self.frontier :])

    def _name(self, calls: AutoCalls, ch: str, out: list[dict[str, Any]]) -> bool:
        """One character of the name, or the { or [ that ends it: whether it reads on."""
        if self.stage == "space":
            self.stage, self.name_start = "name", self.at
        name = self.text[self.name_start : self.at]
        if ch in "{[":
            if not calls.may_call(name):
                return False
            if ch == "{":
                self._start(calls, out)
                self.stage = "arguments"
            else:
                self.stage, self.args_start = "args", self.at
                self.at += 1
            return True
        prefix = name + ch
        if not any(n.startswith(prefix) and calls.may_call(n) for n in calls.names):
            return False
        self.at += 1
        return True

    def _start(self, calls: AutoCalls, out: list[dict[str, Any]]) -> None:
        """The name ended: the call's first delta."""
        name_end = self.at if self.stage == "name" else self.args_start
        out.append(calls.start_call(self.text[self.name_start : name_end], ""))
        self.index = calls.calls - 1
        self.frontier = self.at

    def _send(self, out: list[dict[str, Any]]) -> None:
        """The arguments read since the last delta."""
        if self.at > self.frontier:
            out.append(arguments_delta(self.index, self.text[self.frontier : self.at]))
            self.frontier = self.at

    def _broken(self, out: list[dict[str, Any]]) -> str:
        """The call breaks at `at`: what it held since its call's text is content; the
        text from `at` on is read as text."""
        out += content(self.text[self.frontier : self.at])
        return self.text[self.at :]
