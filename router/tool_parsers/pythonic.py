"""tool_call_parser "pythonic": Llama 3.2 / Llama 4 (and ToolACE) write a call answer as a
Python list of calls, `[get_weather(city="oslo"), now()]`, Llama 4 optionally between
<|python_start|> and <|python_end|> (special tokens: in the text only with
skip_special_tokens false). It is read with `ast`, never run: each call is a plain name
with keyword arguments only, each value a literal (`ast.literal_eval`) JSON can hold;
anything else is text, as vLLM's pythonic parser leaves it.

Each call is sent whole as soon as the `,` or `]` after it arrives and the answer so far,
closed there, reads as such a list (a call's `)` alone does not tell: `.x`, `(...)` or
` if ...` may follow it). An answer that begins with `[` (or <|python_start|>) is held
until its first call is sent, or it turns out no list of calls of tools a call may name:
then the whole answer is content, as it came. Once a call was sent, what breaks the list
(an element that is no such call, a second call without parallel_tool_calls, text after
the list) is content from where the last call's text (or the list) ended to the end.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any

from router.tool_calls import AnswerCalls

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
UNREADABLE = (SyntaxError, ValueError, TypeError, RecursionError, MemoryError)
"""What `ast` and `json` raise on text that is not a literal (or too deep, too large)."""


@dataclass
class PythonicCalls(AnswerCalls):
    """An answer that begins with `[` (or <|python_start|>) is a list of calls."""

    starts: tuple[str, ...] = ("[", PYTHON_START)
    scanned: int = 0
    """answer[:scanned] was looked at for the , and ] that may end a call."""
    last: str = ""
    """The last character scanned that is no whitespace."""
    frontier: int = 0
    """Where the last call's text (or the list, once closed) ends in answer (0: none)."""
    closed: bool = False
    """The list closed, all its calls sent: what follows is read at the end."""

    def read(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while self.calls_answer and not self.closed and self.scanned < len(self.answer):
            at, ch = self.scanned, self.answer[self.scanned]
            self.scanned += 1
            if ch == "]" or (ch == "," and self.last == ")"):
                out += self._list_read(at)
            if not ch.isspace():
                self.last = ch
        return out

    def _list_read(self, at: int) -> list[dict[str, Any]]:
        """The answer up to `at` (a , or ]) closed there: the calls it newly holds when it
        reads as a list; the answer breaks where it holds no call a call may be."""
        lead = _lead(self.answer)
        source = self.answer[lead : at + 1] + ("]" if self.answer[at] == "," else "")
        items = list_items(source)
        if items is None:
            return []
        out = []
        for node in items[self.calls :]:
            call = _call(node)
            if call is None or not self.may_call(call[0]):
                return out + self.give_up(self.frontier)
            out.append(self.start_call(*call))
            self.frontier = lead + _offset(source, node.end_lineno, node.end_col_offset)
        if self.answer[at] == "]":
            if not items:  # [] is no call
                return self.give_up(0)
            self.closed, self.frontier = True, at + 1
        return out

    def read_end(self) -> list[dict[str, Any]]:
        calls = pythonic_calls(self.answer)
        if calls is not None and len(calls) == self.calls:
            return []  # all sent as they closed; what follows the list is the answer's
        if self.calls or calls is None:
            return self.give_up(self.frontier)
        if not all(self.may_call(name, before) for before, (name, _) in enumerate(calls)):
            return self.give_up(0)
        return [self.start_call(*call) for call in calls]


def pythonic_calls(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call of a `[f(a=1), g()]` answer, else None.
    Example: '[f(a=1, b=[True, None])]' -> [("f", '{"a": 1, "b": [true, null]}')]."""
    items = list_items(text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip())
    if not items:
        return None
    calls = []
    for node in items:
        call = _call(node)
        if call is None:
            return None
        calls.append(call)
    return calls


def list_items(source: str) -> list[ast.expr] | None:
    """The elements of a Python list expression's source, else None."""
    try:
        tree = ast.parse(source, mode="eval")
    except UNREADABLE:
        return None
    return tree.body.elts if isinstance(tree.body, ast.List) else None


def _lead(answer: str) -> int:
    """Where an answer's list begins: after whitespace and <|python_start|>."""
    start = answer.lstrip()
    if start.startswith(PYTHON_START):
        start = start[len(PYTHON_START) :].lstrip()
    return len(answer) - len(start)


def _offset(source: str, line: int | None, column: int | None) -> int:
    """The index in source of `ast`'s (line from 1, column in UTF-8 bytes)."""
    assert line is not None and column is not None
    starts = [0] + [m.end() for m in re.finditer("\r\n|\r|\n", source)]
    start = starts[line - 1]
    return start + len(source[start:].encode()[:column].decode())


def _call(node: ast.expr) -> tuple[str, str] | None:
    """f(a=<literal>, ...) -> ("f", arguments JSON); positional or ** arguments, a
    non-literal value, or one JSON cannot hold (a set, bytes, NaN) -> None."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    if any(keyword.arg is None for keyword in node.keywords):
        return None
    try:
        arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        return node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except UNREADABLE:
        return None
