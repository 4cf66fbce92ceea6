"""Reasoning models' thinking, split from their answer: the cluster's `reasoning_parser`
reads a chat choice's text into `reasoning_content` (vLLM's field) and `content`.

    deepseek_r1   the output begins inside the reasoning (DeepSeek-R1's template opens
                  <think> in the prompt; a leading <think> is dropped too) and </think>
                  ends it; an output that never closes it is all reasoning
    qwen3         reasoning only when the output begins with <think> (Qwen 3, QwQ; with
                  chat_template_kwargs {"enable_thinking": false} it does not), up to
                  </think>; otherwise all content

The reader works on text pieces as they stream: a tail that may begin a tag is held
until the next piece tells.

A chat with a structured output (its own, or a forced tool call's grammar) thinks first,
as in vLLM: the grammar starts after the output's </think> (`SamplingParams.structured_after`,
set by `router.frontend.Frontend.thinking_first`), so the thinking is free and the answer
is held to the grammar. A prompt that closed the thinking itself (`thinking_closed`, read
off the prompt's token ids: `tag_ids`) leaves none to do: the grammar holds the output from
its first token, and JSON held so is not read for thinking (`router.chat_reader.reader_of`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from replica.sampling_checks import MAX_STRUCTURED_AFTER

log = logging.getLogger("lorafleet.router")
PARSERS = ("deepseek_r1", "qwen3")
OPEN, CLOSE = "<think>", "</think>"


@dataclass
class ThinkReader:
    """Text pieces -> deltas {"reasoning_content": ...} and {"content": ...}.
    parser: one of PARSERS."""

    parser: str
    state: str = "start"
    """"start" (nothing decided yet), "thinking", or "answer"."""
    held: str = ""

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.held += text
        out: list[dict[str, Any]] = []
        if self.state == "start":
            if OPEN.startswith(self.held) and len(self.held) < len(OPEN):
                return out  # may still begin <think>
            if self.held.startswith(OPEN):
                self.held, self.state = self.held[len(OPEN) :], "thinking"
            else:
                self.state = "thinking" if self.parser == "deepseek_r1" else "answer"
        if self.state == "thinking":
            close = self.held.find(CLOSE)
            if close < 0:
                keep = tag_tail(self.held, CLOSE)
                out += _delta("reasoning_content", self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                return out
            out += _delta("reasoning_content", self.held[:close])
            self.held, self.state = self.held[close + len(CLOSE) :], "answer"
        out += _delta("content", self.held)
        self.held = ""
        return out

    def end(self) -> list[dict[str, Any]]:
        """What is held once the choice finished: a cut-off tag is text of its part."""
        held, self.held = self.held, ""
        if self.state == "start":
            kind = "reasoning_content" if self.parser == "deepseek_r1" else "content"
            return _delta(kind, held)
        return _delta("reasoning_content" if self.state == "thinking" else "content", held)


def tag_ids(tokenizer, tag: str) -> tuple[int, ...]:
    """The ids of `tag` (OPEN or CLOSE) as the tokenizer encodes it alone: those after which
    a reasoning model's structured output starts (CLOSE: `SamplingParams.structured_after`),
    and what `thinking_closed` looks for in a prompt. One added token in reasoning models'
    tokenizers (DeepSeek-R1's, Qwen 3's), found wherever the text holds the tag; where it
    is several, text that spells the tag in other pieces (a merge across its edge) is not
    seen as the tag (a warning says so)."""
    ids = tuple(tokenizer.encode(tag, add_special_tokens=False))
    if not 1 <= len(ids) <= MAX_STRUCTURED_AFTER:
        raise ValueError(
            f"reasoning_parser: the tokenizer encodes {tag} as {len(ids)} tokens; allowed: "
            f"1 to {MAX_STRUCTURED_AFTER}"
        )
    if len(ids) > 1:
        log.warning(
            "reasoning_parser: the tokenizer encodes %s as %d tokens, not one; it is seen "
            "(in a prompt, or ending the thinking of an output) only where spelled in "
            "exactly these",
            tag,
            len(ids),
        )
    return ids


def thinking_closed(
    prompt_ids: Sequence[int], open_ids: Sequence[int], close_ids: Sequence[int]
) -> bool:
    """Whether a rendered prompt closed the thinking itself: its ids after the last run of
    open_ids (<think>'s, `tag_ids`) hold a run of close_ids (</think>'s). Example, <think>
    = (7,) and </think> = (8,): Qwen 3's template with chat_template_kwargs
    {"enable_thinking": false} ends the prompt "<think>\n\n</think>\n\n", (.., 7, 5, 8, 5)
    -> True; a prompt that opens <think> (DeepSeek-R1's: (.., 7, 5)) or has none -> False.
    Where both tags are one token, as in reasoning models' tokenizers, this is the text
    rule (the decoded prompt's text after its last <think> holds </think>) without
    decoding."""
    last = max(_runs(prompt_ids, open_ids), default=-1)
    return last >= 0 and any(True for _ in _runs(prompt_ids, close_ids, last + len(open_ids)))


def _runs(ids: Sequence[int], run: Sequence[int], start: int = 0) -> Iterator[int]:
    """Where `run` occurs in ids from `start` on, in order. Hops between occurrences of its
    first id with `index` (C speed: a prompt of 100k ids holds few <think>s)."""
    first, k, i = run[0], len(run), start
    while True:
        try:
            i = ids.index(first, i)
        except ValueError:
            return
        if tuple(ids[i : i + k]) == tuple(run):
            yield i
        i += 1


def tag_tail(text: str, tag: str) -> int:
    """Length of the longest tail of text that begins tag (0: none): what a streamed
    reader holds back until the next piece tells (also `router.tool_parsers`)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def _delta(kind: str, text: str) -> list[dict[str, Any]]:
    return [{kind: text}] if text else []
