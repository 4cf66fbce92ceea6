"""tool_call_parser "pythonic": Llama 3.2 / Llama 4 (and ToolACE) write a call answer as a
Python list of calls, `[get_weather(city="oslo"), now()]`, Llama 4 optionally between
<|python_start|> and <|python_end|> (special tokens: in the text only with
skip_special_tokens false). It is read with `ast`, never run: each call is a plain name
with keyword arguments only, each value a literal (`ast.literal_eval`) JSON can hold;
anything else is text, as vLLM's pythonic parser leaves it.

Each call is sent whole as soon as the `,` or `]` after it arrives (at the list's level,
outside strings and comments) and its element, parsed alone, reads as such a call (a
call's `)` alone does not tell: `.x`, `(...)` or ` if ...` may follow it); each element
is parsed once, so an answer is read in time linear in its length. An answer that begins
with `[` (or <|python_start|>) is held until its first call is sent, or it turns out no
list of calls of tools a call may name: then the whole answer is content, as it came.
Once a call was sent, what breaks the list (an element that is no such call, a second
call without parallel_tool_calls, text after the list) is content from where the last
call's text (or the list) ended to the end.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

from router.tool_calls import AnswerCalls

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
UNREADABLE = (SyntaxError, ValueError, TypeError, RecursionError, MemoryError)
"""What `ast` and `json` raise on text that is not a literal (or too deep, too large)."""
SOURCE = "<pythonic tool call>"
"""The file name `ast` parses the model's text under: the module of the warnings it
raises on it (an invalid escape such as "\\d": SyntaxWarning on Python 3.12+,
DeprecationWarning before; a literal such as "1if": SyntaxWarning)."""

_QUIET = ("ignore", None, Warning, re.compile(re.escape(SOURCE) + r"\Z"), 0)
"""The warnings filter (as `warnings.filters` holds it) that ignores SOURCE's warnings."""


def quiet_source() -> None:
    """The model's text cannot make `ast` warn into the logs: one filter in the
    process-wide list ignores SOURCE's warnings and no others'. It is put there once, at
    import, and again only where it went missing (an import inside a
    warnings.catch_warnings() block, as pytest's collection is, loses it at the block's
    end). Never warnings.catch_warnings() around each parse: that swaps the process-wide
    list in and out, so parsers on two threads (the router reads choices on several)
    interleave their saves and restores, and can leave "ignore everything" installed for
    good or drop a filter another thread added. A filter put in front of this one after
    it (warnings.simplefilter("always") at run time) still wins; -W and PYTHONWARNINGS,
    set at start, do not."""
    if _QUIET not in warnings.filters:
        warnings.filterwarnings("ignore", module=_QUIET[3].pattern)


quiet_source()


@dataclass
class PythonScan:
    """Where Python source stands, read on from its start: `depth` of the brackets open
    outside strings and comments. Enough of Python's lexing to find a list's separators
    and its end: strings (any prefix, triple-quoted or not, a backslash escaping what
    follows) and comments."""

    depth: int = 0
    quote: str = ""
    """The open string's quote: ', ", \'\'\' or \"\"\" ("": outside strings)."""
    comment: bool = False

    def step(self, text: str, i: int) -> tuple[int, bool]:
        """Reads on at text[i]: (how many characters it took, 0 while text does not tell
        yet, as after a quote that may begin or end a triple one; whether text[i] is
        structure: a bracket or comma outside strings and comments)."""
        ch = text[i]
        if self.comment:
            self.comment = ch not in "\r\n"
            return 1, False
        near_end = len(text) - i < 3
        if self.quote:
            if ch == "\\":
                return (2 if i + 1 < len(text) else 0), False
            if text.startswith(self.quote, i):
                took, self.quote = len(self.quote), ""
                return took, False
            waits = near_end and len(self.quote) == 3 and self.quote.startswith(text[i:])
            return (0 if waits else 1), False
        if ch == "#":
            self.comment = True
        elif ch in "'\"":
            if text.startswith(ch * 3, i):
                self.quote = ch * 3
                return 3, False
            if near_end and text[i:] in (ch, ch * 2):
                return 0, False  # "" may be an empty string or begin a triple quote
            self.quote = ch
        elif ch in "([{":
            self.depth += 1
            return 1, True
        elif ch in ")]}":
            self.depth -= 1
            return 1, True
        return 1, ch == ","


@dataclass
class PythonicCalls(AnswerCalls):
    """An answer that begins with `[` (or <|python_start|>) is a list of calls. Each
    element is parsed alone once the , at the list's level or the ] that closes it
    arrives (`_element`), so the answer is parsed in linear time; the pieces join into the
    whole list's parse, as each begins where the list's level begins afresh."""

    starts: tuple[str, ...] = ("[", PYTHON_START)
    stage: str = "lead"
    """"lead" (before the list's [), "list" (reading its elements), "closed" (its ]
    read, all its calls sent: what follows is read at the end), or "whole" (no [ after
    the lead: the answer is read whole at the end)."""
    scan: PythonScan = field(default_factory=PythonScan)
    scanned: int = 0
    """answer[:scanned] was scanned (in "lead": read as the lead)."""
    piece: int = 0
    """The [ or , after which the next element's text begins, in answer."""
    frontier: int = 0
    """Where the last call's text (or the list, once closed) ends in answer (0: none)."""

    def read(self, text: str) -> list[dict[str, Any]]:
        if self.stage == "lead" and not self._lead():
            return []
        out: list[dict[str, Any]] = []
        base = len(self.answer) - len(text)
        if self.scanned < base:  # the scan held back a quote that may begin a triple one
            text, base = self.answer[self.scanned :], self.scanned
        while self.calls_answer and self.stage == "list" and self.scanned < base + len(text):
            at = self.scanned
            took, structure = self.scan.step(text, at - base)
            if not took:
                break
            self.scanned += took
            if structure and (
                self.scan.depth == 0 or (self.scan.depth == 1 and text[at - base] == ",")
            ):
                out += self._element(at)
        return out

    def _lead(self) -> bool:
        """Reads on through the answer's lead (whitespace and <|python_start|>, from
        `scanned`): whether the list's [ (or what is no list) came after it."""
        if self.scanned == 0:
            tag = self.answer.startswith(PYTHON_START, self.lead)
            self.scanned = self.lead + (len(PYTHON_START) if tag else 0)
        rest = self.answer[self.scanned :]
        start = rest.lstrip()
        self.scanned += len(rest) - len(start)
        if not start:
            return False
        self.stage = "list" if start[0] == "[" else "whole"
        self.piece = self.scanned
        return True

    def _element(self, at: int) -> list[dict[str, Any]]:
        """The element before `at` (a , at the list's level, or the bracket that closes
        it) ended: parsed alone, from the last piece on, as a list of it; its call, when it
        is one a call may be. Else the answer breaks, at an element that is no such call or
        text that reads as no list: no later text mends that into calls (a comma at the
        list's level that ends no element is a lambda's, which is no call)."""
        comma = self.answer[at] == ","
        source = "[" + self.answer[self.piece + 1 : at + 1] + ("]" if comma else "")
        items = list_items(source)
        if items is None:
            return self.give_up(self.frontier)
        out = []
        for node in items:  # one element at most: the piece holds no comma of the list's
            call = _call(node)
            if call is None or not self.may_call(call[0]):
                return self.give_up(self.frontier)
            out.append(self.start_call(*call))
            self.frontier = self.piece + _offset(source, node.end_lineno, node.end_col_offset)
        if comma:
            self.piece = at
        elif not self.calls:  # [] is no call
            return self.give_up(0)
        else:
            self.stage, self.frontier = "closed", at + 1
        return out

    def read_end(self) -> list[dict[str, Any]]:
        calls = pythonic_calls(str(self.answer))
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
    """The elements of a Python list expression's source, else None; parsed as SOURCE,
    whose warnings are ignored."""
    quiet_source()
    try:
        tree = ast.parse(source, filename=SOURCE, mode="eval")
    except UNREADABLE:
        return None
    return tree.body.elts if isinstance(tree.body, ast.List) else None


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
