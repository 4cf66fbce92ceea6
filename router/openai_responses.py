"""OpenAI-compatible response bodies (completions, chat, models, SSE framing)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from router.logprobs import Candidate, TokenLogprob


@dataclass(frozen=True)
class Head:
    """What every body and chunk of one response repeats: its id, the `model` it names
    and `created`, taken once (OpenAI: each chunk of a stream has the same timestamp)."""

    id: str
    model: str
    created: int

    @classmethod
    def now(cls, rid: str, model: str) -> Head:
        return cls(rid, model, int(time.time()))

    def fields(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def to_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@dataclass
class Piece:
    """One step of output: text, the logprobs of its tokens (if asked), finish reason."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


def _completion_logprobs(piece: Piece) -> dict[str, Any]:
    entries = piece.logprobs
    return {
        "tokens": [e.sampled.token for e in entries],
        "token_logprobs": [e.sampled.logprob for e in entries],
        "top_logprobs": [_top_dict(e) for e in entries],
        "text_offset": [e.text_offset for e in entries],
    }


def _top_dict(entry: TokenLogprob) -> dict[str, float] | None:
    """OpenAI legacy semantics: the k most likely tokens plus the sampled one (<= k + 1);
    None for an echoed prompt's first token, which has no logprob.

    Token strings are distinct but for tokens that spell the same text; such a key keeps
    the likeliest, and the sampled token's key always holds its own logprob.
    """
    if entry.sampled.logprob is None:
        return None
    top: dict[str, float] = {}
    for c in entry.top:
        top.setdefault(c.token, c.logprob)
    top[entry.sampled.token] = entry.sampled.logprob
    return top


def _chat_token(c: Candidate) -> dict[str, Any]:
    return {"token": c.token, "logprob": c.logprob, "bytes": list(c.raw)}


def _chat_logprobs(piece: Piece) -> dict[str, Any]:
    return {
        "content": [
            {**_chat_token(e.sampled), "top_logprobs": [_chat_token(c) for c in e.top]}
            for e in piece.logprobs
        ]
    }


def _completion_choice(index: int, piece: Piece, want_logprobs: bool) -> dict[str, Any]:
    return {
        "index": index,
        "text": piece.text,
        "logprobs": _completion_logprobs(piece) if want_logprobs else None,
        "finish_reason": piece.finish_reason,
    }


def completion_body(
    head: Head, pieces: Sequence[Piece], usage: Usage, want_logprobs: bool
) -> dict[str, Any]:
    """A whole /v1/completions response: choice i is pieces[i]."""
    choices = [_completion_choice(i, p, want_logprobs) for i, p in enumerate(pieces)]
    return {**head.fields("text_completion"), "choices": choices, "usage": usage.to_dict()}


def completion_chunk(head: Head, index: int, piece: Piece, want_logprobs: bool) -> dict[str, Any]:
    """One /v1/completions stream chunk, of choice `index`."""
    return {
        **head.fields("text_completion"),
        "choices": [_completion_choice(index, piece, want_logprobs)],
    }


def chat_body(
    head: Head,
    pieces: Sequence[Piece],
    usage: Usage,
    want_logprobs: bool,
    messages: Sequence[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A whole /v1/chat/completions response: choice i is pieces[i], its message
    messages[i] when given (tool calls: `router.tools.whole_message`), else its text."""
    choices = [
        {
            "index": i,
            "message": messages[i] if messages else {"role": "assistant", "content": p.text},
            "logprobs": _chat_logprobs(p) if want_logprobs else None,
            "finish_reason": p.finish_reason,
        }
        for i, p in enumerate(pieces)
    ]
    return {**head.fields("chat.completion"), "choices": choices, "usage": usage.to_dict()}


def chat_chunk(
    head: Head, index: int, delta: dict[str, Any], piece: Piece | None, want_logprobs: bool
) -> dict[str, Any]:
    """One /v1/chat/completions stream chunk, of choice `index`."""
    return {
        **head.fields("chat.completion.chunk"),
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": _chat_logprobs(piece) if want_logprobs and piece else None,
                "finish_reason": piece.finish_reason if piece else None,
            }
        ],
    }


def usage_chunk(head: Head, obj: str, usage: Usage) -> dict[str, Any]:
    """The last stream chunk when stream_options.include_usage: no choices, usage set."""
    return {
        **head.fields(obj),
        "choices": [],
        "usage": usage.to_dict(),
    }


def model_card(model_id: str, parent: str | None, owned_by: str) -> dict[str, Any]:
    """One entry of GET /v1/models (adapters carry `parent` = the base model id)."""
    return {
        "id": model_id,
        "object": "model",
        "created": 0,
        "owned_by": owned_by,
        "root": model_id,
        "parent": parent,
    }


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event (`data: ...` + blank line); a str is sent verbatim ([DONE])."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
