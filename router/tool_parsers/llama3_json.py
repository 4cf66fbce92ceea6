"""tool_call_parser "llama3_json": Llama 3.1 / 3.2 write a call answer as one or more
{"name": ..., "parameters": {...}} objects separated by ";", optionally after
<|python_tag|>; any other answer is text. The answer is read whole (`AnswerCalls`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from router.tool_calls import AnswerCalls, call_of

PYTHON_TAG = "<|python_tag|>"


@dataclass
class Llama3Calls(AnswerCalls):
    """An answer that begins with `{` (or <|python_tag|>) is ";"-separated call objects."""

    starts: tuple[str, ...] = ("{", PYTHON_TAG)

    def read(self, answer: str) -> list[tuple[str, str]] | None:
        return llama3_calls(answer.lstrip().removeprefix(PYTHON_TAG))


def llama3_calls(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each ";"-separated {"name", "parameters"} object, else None."""
    decoder, calls, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return calls or None
        try:
            item, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        call = call_of(item)
        if call is None:
            return None
        calls.append(call)
