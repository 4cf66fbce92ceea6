"""tool_call_parser "pythonic": Llama 3.2 / Llama 4 (and ToolACE) write a call answer as a
Python list of calls, `[get_weather(city="oslo"), now()]`, Llama 4 optionally between
<|python_start|> and <|python_end|> (special tokens: in the text only with
skip_special_tokens false). The answer is read whole (`AnswerCalls`) with `ast`, never
run: each call is a plain name with keyword arguments only, each value a literal
(`ast.literal_eval`) JSON can hold; anything else is text, as vLLM's pythonic parser
leaves it."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass

from router.tool_calls import AnswerCalls

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
UNREADABLE = (SyntaxError, ValueError, TypeError, RecursionError, MemoryError)
"""What `ast` and `json` raise on text that is not a literal (or too deep, too large)."""


@dataclass
class PythonicCalls(AnswerCalls):
    """An answer that begins with `[` (or <|python_start|>) is a list of calls."""

    starts: tuple[str, ...] = ("[", PYTHON_START)

    def read(self, answer: str) -> list[tuple[str, str]] | None:
        return pythonic_calls(answer)


def pythonic_calls(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call of a `[f(a=1), g()]` answer, else None.
    Example: '[f(a=1, b=[True, None])]' -> [("f", '{"a": 1, "b": [true, null]}')]."""
    text = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
    try:
        tree = ast.parse(text, mode="eval")
    except UNREADABLE:
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        call = _call(node)
        if call is None:
            return None
        calls.append(call)
    return calls


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
