"""Checks of OpenAI request bodies that pydantic's types do not express.

`invalid_text` finds strings that are not Unicode text: JSON's `\\ud800` escape decodes to
a lone surrogate, which no tokenizer or UTF-8 encoder accepts, so the body is refused
where it is parsed instead of failing deep inside tokenization. `only_neutral` refuses
fields we cannot honour unless they hold their neutral value, which clients send as
defaults; `refuse_unhonoured` does the same for vLLM's fields the body models leave
out. The `check_*` shape checks run before pydantic's own types see a union-typed
field, whose errors would name the union's members (`content.str`, `list[TextPart]`,
"and 2 more") instead of what is allowed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from pydantic import AfterValidator

from replica.sampling_checks import MAX_TOP_LOGPROBS

TEXT_ALLOWED = "allowed: Unicode text (surrogates \\ud800-\\udfff only as pairs)"
CONTENT_ALLOWED = (
    'allowed: content as a string or a list of {"type": "text", "text": "..."} parts '
    "(only text: image, audio and file parts are not supported)"
)
STOP_ALLOWED = "allowed: a string or a list of strings"


class RefusedAt(ValueError):
    """A validator's refusal of one element inside its field: `at` extends the field's
    dotted path ("messages.0.content" + ("0", "type") -> "messages.0.content.0.type")."""

    def __init__(self, message: str, at: tuple[str, ...] = ()):
        super().__init__(message)
        self.at = at


def json_kind(value: object) -> str:
    """What a JSON value is, for messages: "a number", "an object", ..."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "null" if value is None else "an object"


def check_content(content: object) -> object:
    """A chat message's content: a string, null (the message's role decides) or a list of
    text parts. Example: [{"type": "image_url", ...}] -> RefusedAt at ("0", "type")."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RefusedAt(f"got {json_kind(content)}; {CONTENT_ALLOWED}")
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise RefusedAt(f"got {json_kind(part)}, not a part; {CONTENT_ALLOWED}", (str(i),))
        kind = part.get("type")
        if kind != "text":
            what = "a part without a type" if kind is None else f"a part of type {json.dumps(kind)}"
            raise RefusedAt(f"{what}; {CONTENT_ALLOWED}", (str(i), "type"))
        if not isinstance(part.get("text"), str):
            got = "missing" if "text" not in part else f"got {json_kind(part['text'])}"
            raise RefusedAt(f"{got}; allowed: a string", (str(i), "text"))
    return content


def check_stop(stop: object) -> object:
    """stop: a string or a list of strings."""
    if isinstance(stop, str):
        return stop
    if not isinstance(stop, list):
        raise RefusedAt(f"got {json_kind(stop)}; {STOP_ALLOWED}")
    for i, item in enumerate(stop):
        if not isinstance(item, str):
            raise RefusedAt(f"got {json_kind(item)}; {STOP_ALLOWED}", (str(i),))
    return stop


def check_top_count(k: int | None) -> int | None:
    """logprobs / top_logprobs k: None or 0..MAX_TOP_LOGPROBS (REST and gRPC)."""
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise ValueError(f"{k} is out of range; allowed: 0 to {MAX_TOP_LOGPROBS}")
    return k


def check_prompt_count(k: int | None) -> int | None:
    """prompt_logprobs k (vLLM's): None or 0..MAX_TOP_LOGPROBS. vLLM's -1 (the whole
    vocabulary) is refused by name: vLLM itself refuses it unless its max_logprobs is -1."""
    if k == -1:
        raise ValueError(
            f"-1 (every token of the vocabulary) is not supported; allowed: null or 0 to "
            f"{MAX_TOP_LOGPROBS}"
        )
    return check_top_count(k)


COMPLETION_MAX_TOKENS = 16
"""max_tokens of a completion that does not send it (REST's /v1/completions, a gRPC prompt),
OpenAI's and vLLM's default. A chat's default is the room its prompt leaves in the context."""


def check_max_tokens(max_tokens: int, scores_prompt: bool, how: str) -> int:
    """max_tokens: >= 1, or 0 where the request returns its prompt only, e.g. to score it
    (scores_prompt; how names what allows 0: REST's "echo: true or prompt_logprobs set",
    gRPC's "prompt_logprobs set")."""
    if max_tokens >= 1 or (scores_prompt and max_tokens == 0):
        return max_tokens
    raise ValueError(
        f"max_tokens: got {max_tokens}; allowed: an integer >= 1, or 0 with {how} (the "
        "prompt only, e.g. to score it with logprobs)"
    )


MAX_CACHE_SALT_CHARS = 256
CACHE_SALT_ALLOWED = (
    f"allowed: null or a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters"
)


def check_cache_salt(salt: str | None) -> str | None:
    """cache_salt (vLLM's): a request shares prefix-cache blocks only with requests of the
    same salt (`router.prepared.cache_salt_of`)."""
    if salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise ValueError(f"got a string of {len(salt)} characters; {CACHE_SALT_ALLOWED}")
    return salt


MAX_DEPTH = 64
"""Nesting levels of arrays and objects a body may have (OpenAI bodies need under 10; a
tool's JSON schema a few more). Deeper bodies overflow the recursive checks: 500s."""
DEPTH_ALLOWED = f"allowed: at most {MAX_DEPTH} levels of nested arrays and objects"
_DIGITS = sys.get_int_max_str_digits()
NUMBER_TOO_LONG = (
    f"a number of more than {_DIGITS} digits; allowed: numbers of at most {_DIGITS} digits"
)
"""Python's json refuses (a plain ValueError) to convert an integer longer than this."""


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
            raise ValueError(_not_supported(value, allowed))
        return value

    return AfterValidator(check)


def _not_supported(value: object, allowed: str) -> str:
    return f"got {json.dumps(value)}; allowed: {allowed} (not supported)"


def _false(value: object) -> bool:
    return value is False


def _true(value: object) -> bool:
    return value is True


def _empty(value: object) -> bool:
    return value in ([], {})


def _nothing(value: object) -> bool:  # null (checked before) is the only neutral value
    return False


Unhonoured = dict[str, tuple[Callable[[object], bool], str]]
"""field -> (is its value neutral, the neutral values for the message)."""

UNHONOURED_SAMPLING: Unhonoured = {
    "use_beam_search": (_false, "false or null"),
    "return_tokens_as_token_ids": (_false, "false or null"),
    "bad_words": (_empty, "[] or null"),
    "logits_processors": (_empty, "[] or null"),
}
"""Fields of vLLM's OpenAI server (and OpenAI's) that change what the client gets and that
lorafleet does not implement. They are not fields of the body models, whose unknown fields
are ignored, so without this check a client relying on one (a JSON schema, beam search)
would silently get output made without it."""

UNHONOURED_COMPLETION: Unhonoured = UNHONOURED_SAMPLING
"""response_format and the structured-output fields: `router.structured_request`."""
UNHONOURED_CHAT: Unhonoured = UNHONOURED_SAMPLING | {
    "functions": (_empty, "[] or null"),
    "function_call": (lambda c: c in ("none", "auto"), '"none", "auto" or null'),
    "chat_template": (_nothing, "null"),
    "documents": (_nothing, "null"),
    "modalities": (lambda m: m == ["text"], '["text"] or null'),
    "audio": (_nothing, "null"),
}


def refuse_unhonoured(body: object, fields: Unhonoured) -> object:
    """A body-level check: ValueError naming the first field of `fields` whose value is
    neither null nor neutral. Example: {"use_beam_search": true} -> "use_beam_search: got
    true; allowed: false or null (not supported)"."""
    if not isinstance(body, dict):
        return body
    for name, (neutral, allowed) in fields.items():
        value = body.get(name)
        if value is not None and not neutral(value):
            raise ValueError(f"{name}: {_not_supported(value, allowed)}")
    return body
