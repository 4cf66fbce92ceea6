"""Tool call ids in the shape the served model's chat template takes, going out and
coming back. The cluster's `tool_call_parser` names the shape:

    mistral       9 letters and digits, "a1B2c3D4e": Mistral's chat templates (and
                  mistral-common) refuse any other id ("Tool call IDs should be
                  alphanumeric strings with length 9!")
    the others    OpenAI's, "call_" and 24 hex digits

Out: every call lorafleet reads from an answer (forced or "auto", streamed or whole, REST
or gRPC) takes its id from the choice's `CallIds`. Back: a client returns ids in later
turns (an assistant message's `tool_calls[].id`, a tool message's `tool_call_id`), often
made elsewhere (OpenAI's "call_..."); `template_call_ids` maps those that are not 9
letters and digits to such an id before a Mistral template renders them, the same id to
the same one, so a call and the tool message answering it still match. (vLLM keeps a
longer id's last 9 characters instead: a shorter id, or one with "_" or "-" in its last
9, is still refused.)
"""

from __future__ import annotations

import hashlib
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

ALPHANUMERIC = string.ascii_letters + string.digits
MISTRAL_ID = re.compile("[A-Za-z0-9]{9}")
"""A Mistral call id: 9 letters and digits."""


def mistral_style(parser: str | None) -> bool:
    """Whether the calls of a cluster with this tool_call_parser take Mistral's ids."""
    return parser == "mistral"


def new_call_id(mistral: bool = False) -> str:
    """A fresh random id: 9 letters and digits (mistral), else OpenAI's "call_" + 24 hex."""
    if mistral:
        return "".join(secrets.choice(ALPHANUMERIC) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallIds:
    """The ids of one choice's calls, each one no earlier call's of the choice.
    mistral: Mistral's shape (9 letters and digits), else OpenAI's."""

    mistral: bool = False
    given: set[str] = field(default_factory=set)

    def next(self, written: str = "") -> str:
        """The next call's id: `written` (the id the model wrote for it) when it has the
        shape and is no earlier call's, else a fresh one."""
        fits = bool(MISTRAL_ID.fullmatch(written)) if self.mistral else bool(written)
        call_id = written if fits and written not in self.given else new_call_id(self.mistral)
        while call_id in self.given:
            call_id = new_call_id(self.mistral)
        self.given.add(call_id)
        return call_id


def mistral_call_id(call_id: str) -> str:
    """A client's call id as Mistral's templates take it: itself when 9 letters and
    digits, else 9 letters and digits of its SHA-256 (base 62), the same for the same id.
    Example: "a1B2c3D4e" -> "a1B2c3D4e"; "call_abc" -> the same 9 characters every time."""
    if MISTRAL_ID.fullmatch(call_id):
        return call_id
    n = int.from_bytes(hashlib.sha256(call_id.encode()).digest(), "big")
    out = []
    for _ in range(9):
        n, digit = divmod(n, len(ALPHANUMERIC))
        out.append(ALPHANUMERIC[digit])
    return "".join(out)


def template_call_ids(messages: list[dict[str, Any]], parser: str | None) -> list[dict[str, Any]]:
    """Chat messages as the template takes them (`router.openai_protocol.chat_dicts`),
    their call ids (assistant `tool_calls[].id`, tool `tool_call_id`) mapped by
    `mistral_call_id` when parser is Mistral's; else the messages as given. The messages
    given are not changed."""
    if not mistral_style(parser):
        return messages
    out = []
    for m in messages:
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "id": mistral_call_id(c["id"])} for c in m["tool_calls"]]
        if "tool_call_id" in m:
            m["tool_call_id"] = mistral_call_id(m["tool_call_id"])
        out.append(m)
    return out
