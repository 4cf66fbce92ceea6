"""Parsing a JSON request body into one of the request models: every problem becomes an
`InvalidRequest` naming the field at fault, in the words of `router.body_checks`."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from lora_core.errors import InvalidRequest
from replica.structured_spec import too_deep
from router import structured_request
from router.body_checks import (
    DEPTH_ALLOWED,
    MAX_DEPTH,
    NUMBER_TOO_LONG,
    TEXT_ALLOWED,
    RefusedAt,
    invalid_text,
    json_kind,
)

M = TypeVar("M", bound=BaseModel)
BIG_BODY = 64 * 1024
"""Bodies larger than this are parsed in a worker thread: validating a 6 MB list of token
ids takes ~1 s of CPU, which on the event loop stalled every request on the ingress."""


GRAMMAR_FIELDS = tuple(f'"{name}"'.encode() for name in (*structured_request.FIELDS, "tools"))
"""A body naming one of these may ask for a structured output or a forced tool call,
whose grammar is built while it is parsed (milliseconds for a big JSON schema): such
bodies are parsed in a worker thread too."""


async def parse_request(model: type[M], body: bytes) -> M:
    """`parse_body` for a request body, off the event loop when the body is big or may
    carry a grammar to build."""
    if len(body) <= BIG_BODY and not any(f in body for f in GRAMMAR_FIELDS):
        return parse_body(model, body)
    return await asyncio.to_thread(parse_body, model, body)


def parse_body(model: type[M], body: bytes | str | dict) -> M:
    """Parse and validate a JSON body into `model`; any problem -> InvalidRequest."""
    if isinstance(body, bytes | str):
        body = load_json(body or b"null", None)
    if not isinstance(body, dict):
        raise InvalidRequest("body: allowed: a JSON object")
    if too_deep(body, MAX_DEPTH):
        raise InvalidRequest(f"body: nested more than {MAX_DEPTH} levels; {DEPTH_ALLOWED}")
    bad = invalid_text(body)
    if bad:
        loc, problem = bad
        raise InvalidRequest(f"{loc}: not valid Unicode text ({problem}); {TEXT_ALLOWED}", loc)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise InvalidRequest(*_describe(e)) from None


def load_json(text: bytes | str, field: str | None, allowed: str = "") -> object:
    """json.loads; InvalidRequest naming `field` (None: the body; a field: a JSON value
    the request sends as text, gRPC's *_json fields) for text that is not JSON, nests
    too deeply, or holds an integer too long to convert. allowed: what the field takes,
    for the message. A field's value sits one level inside its request, as REST's do in
    their body, so it may nest one level less than a body."""
    where = field or "body"
    allowed = f"; allowed: {allowed}" if allowed else ""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        why = e.msg if hasattr(e, "msg") else e
        raise InvalidRequest(f"{where} is not valid JSON ({why}){allowed}", field) from None
    except RecursionError:  # the parser's own limit, far deeper than MAX_DEPTH
        raise InvalidRequest(f"{where}: nested too deeply; {DEPTH_ALLOWED}", field) from None
    except ValueError:  # an integer longer than int() converts (JSONDecodeError is above)
        raise InvalidRequest(f"{where}: {NUMBER_TOO_LONG}", field) from None
    if field is not None and too_deep(value, MAX_DEPTH - 1):
        raise InvalidRequest(
            f"{field}: nested more than {MAX_DEPTH - 1} levels; allowed: at most "
            f"{MAX_DEPTH - 1} levels of nested arrays and objects",
            field,
        )
    return value


# pydantic's strict type errors -> what the field takes (its range, if any, is checked
# once the type is right, by SamplingParams)
_TYPE_ALLOWED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "an object",
}


# pydantic's bound errors -> (operator, the ctx key holding the bound)
_BOUND = {
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}


def _shown(value: object) -> str:
    """A value as the client sent it when short (5, "wizard"), else what kind it was."""
    text = json.dumps(value)
    return text if len(text) <= 32 else json_kind(value)


def _describe(e: ValidationError) -> tuple[str, str | None]:
    """(message, param): the first error, named by its field's dotted path."""
    first = e.errors()[0]
    path = [str(p) for p in first["loc"]]
    msg = first["msg"]
    if first["type"] == "value_error":  # our validators' own text, without pydantic's prefix
        error = first["ctx"]["error"]
        msg = str(error)
        path += error.at if isinstance(error, RefusedAt) else ()
    elif first["type"] == "model_type":  # pydantic's text names our class
        msg = f"got {json_kind(first['input'])}; allowed: an object"
    elif first["type"] in _TYPE_ALLOWED:  # "Input should be a valid integer": say what came
        got, value = json_kind(first["input"]), first["input"]
        allowed = _TYPE_ALLOWED[first["type"]]
        shown = json.dumps(value) if isinstance(value, int | float) else ""  # bool too
        if 0 < len(shown) <= 32:
            got += f" ({shown})"
        elif shown and first["type"] == "float_type":  # an integer too large for a float
            got += f" of {len(shown.lstrip('-'))} digits"
            allowed = f"a number from -{sys.float_info.max:.4g} to {sys.float_info.max:.4g}"
        msg = f"got {got}; allowed: {allowed}"
    elif first["type"] == "missing":
        # a top-level null reads as not given (_null_means_default), so it lands here too
        msg = "missing; this field is required"
        if len(path) == 1:
            msg = "missing or null; this field is required"
    elif first["type"] == "literal_error":  # "Input should be 'a' or 'b'"
        # pydantic quotes the values as Python does ('user'); a JSON API quotes as JSON
        expected = first["ctx"]["expected"].replace("'", '"')
        msg = f"got {_shown(first['input'])}; allowed: {expected}"
    elif first["type"] in _BOUND:  # "Input should be greater than or equal to 1"
        op, key = _BOUND[first["type"]]
        value = first["input"]
        kind = "an integer" if isinstance(value, int) else "a number"
        msg = f"got {_shown(value)}; allowed: {kind} {op} {first['ctx'][key]}"
    elif first["type"] in ("string_too_short", "too_short"):  # "String should have at..."
        msg = _too_short(first["input"], first["ctx"]["min_length"])
    loc = ".".join(path)
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    if loc:
        return f"{loc}: {msg}{more}", loc
    return f"{msg}{more}", _param_of(msg)


def _too_short(value: str | list, least: int) -> str:
    """pydantic's min_length errors -> what came and what is allowed.
    Example: [] with least 1 -> "got an empty list; allowed: a list of at least 1 item"."""
    kind, unit = ("string", "character") if isinstance(value, str) else ("list", "item")
    got = f"a {kind} of {_count(len(value), unit)}" if value else f"an empty {kind}"
    return f"got {got}; allowed: a {kind} of at least {_count(least, unit)}"


def _count(n: int, unit: str) -> str:
    return f"{n} {unit}" if n == 1 else f"{n} {unit}s"


def _param_of(msg: str) -> str | None:
    """Model validators name their field first ("tool_choice: ...", or a path in it:
    "response_format.json_schema: ..." -> "response_format", "tools[0].function: ..."
    -> "tools"); else None."""
    field, sep, _ = msg.partition(":")
    top = field.split(".", 1)[0].split("[", 1)[0]
    return top if sep and top.isidentifier() else None


def param_of_check(msg: str) -> str | None:
    """The field a registry check names first ("replicas=-1; allowed: ..." -> "replicas")."""
    field, sep, _ = msg.partition("=")
    return field if sep and field.isidentifier() else _param_of(msg)
