"""tool_call_parser "hermes": text, then any number of
<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks, as Hermes, Qwen 2.5 / 3
and the demo's template write them. A call streams as it is generated, as vLLM's hermes
parser streams it (`router.tool_parsers.json_call`): its first delta once its name is
read, then its arguments' JSON text as written, as it arrives.

A block whose object is read whole (it names no tool a call may name, is no JSON object,
or has its "arguments" before its "name") is read at the block's end as it always was: a
call if it reads as one, else content, tags and all. Once a call was sent, what its block
holds besides the call is not dropped: arguments cut (by </tool_call>, a length cut, EOS)
end as written; text after the call's text (after the object, or after the name when the
object breaks before its arguments) is content up to the block's end.

A </tool_call> inside a JSON string of the block's object (an argument that quotes the
tag) is the string's text, not the block's end, unlike vLLM's hermes parser, whose
regular expression ends the block there and breaks the call. In a block that is no JSON
object (its head broke) the first </tool_call> ends it, quotes or not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router.reasoning import tag_tail
from router.tool_calls import AutoCalls, Text, content
from router.tool_parsers.json_call import JsonCall, whole_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class HermesCalls(AutoCalls):
    """Hermes blocks read into calls (module docstring); text outside them is content (a
    tail that may begin a tag is held until it is known)."""

    held: str = ""
    block: JsonCall | None = None
    """The open block's object (its body: the block's text up to where the object ended)."""
    after: Text = field(default_factory=Text)
    """The open block's text after its object ended."""

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
                b = self.block
                if b.stage != "done" and not b.broke and b.scan.in_string:
                    out += self._read(CLOSE)  # inside the call's JSON string: not its end
                    self.held = self.held[close + len(CLOSE) :]
                    continue
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
            self.block = JsonCall()

    def end(self) -> list[dict[str, Any]]:
        held, self.held = self.held, ""
        if self.block is None:
            return content(held)
        return self._read(held) + self._finish(closed=False)  # a block the end cut

    def _read(self, text: str) -> list[dict[str, Any]]:
        """Reads more of the open block's body."""
        assert self.block is not None
        if self.block.stage == "done":
            self.after += text
            return []
        out, took = self.block.read(self, text)
        if took < len(text):
            self.after += text[took:]
        return out

    def _finish(self, closed: bool) -> list[dict[str, Any]]:
        """The block's end (closed: by </tool_call>, else by the end of the text)."""
        b, self.block = self.block, None
        assert b is not None
        body = str(b.body) + str(self.after)
        self.after = Text()
        close = CLOSE if closed else ""
        if b.index < 0:
            return whole_call(self, body) or content(OPEN + body + close)
        rest = body[b.frontier :]
        return content(rest + close) if rest.strip() else []
