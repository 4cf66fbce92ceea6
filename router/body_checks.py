"""Checks of OpenAI request bodies that pydantic's types do not express.

`invalid_text` finds strings that are not Unicode text: JSON's `\\ud800` escape decodes to
a lone surrogate, which no tokenizer or UTF-8 encoder accepts, so the body is refused
where it is parsed instead of failing deep inside tokenization. `only_neutral` refuses
fields we cannot honour unless they hold their neutral value, which clients send as
defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import AfterValidator

TEXT_ALLOWED = "allowed: Unicode text (surrogates \\ud800-\\udfff only as pairs)"


def invalid_text(value: object, path: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """(dotted path, problem) of the first string in `value` (keys too) that is not valid
    Unicode text; None when all are. Example: {"messages": [{"content": "\\ud800"}]} ->
    ("messages.0.content", "lone surrogate \\ud800 at index 0")."""
    if isinstance(value, str):
        return _surrogate(value, path)
    if isinstance(value, dict):
        for key, item in value.items():
            bad = _surrogate(key, path) or invalid_text(item, (*path, key))
            if bad:
                return bad
    if isinstance(value, list):
        for i, item in enumerate(value):
            bad = invalid_text(item, (*path, str(i)))
            if bad:
                return bad
    return None


def _surrogate(text: str, path: tuple[str, ...]) -> tuple[str, str] | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = ".".join(path) or "body"  # a bad key of the top-level object
        return where, f"lone surrogate \\u{ord(text[e.start]):04x} at index {e.start}"
    return None


def only_neutral(neutral: Callable[[Any], bool], allowed: str) -> AfterValidator:
    """A field validator refusing every value but the neutral ones (`allowed` names them)."""

    def check(value: Any) -> Any:
        if not neutral(value):
            raise ValueError(f"{value!r}; allowed: {allowed} (not supported)")
        return value

    return AfterValidator(check)


def is_text_format(fmt: dict[str, object]) -> bool:
    return fmt in ({}, {"type": "text"})
