"""Per-token logprob entries of OpenAI responses: token strings, raw bytes, text offsets.

A token's `raw` bytes are what it contributes to the text, not the UTF-8 of its decoded
string: a byte-level BPE token holding half of a multi-byte character decodes alone to
U+FFFD, yet its raw bytes joined with its neighbours' rebuild the text exactly. Such a
token's string is spelled "bytes:\\xNN..." (OpenAI's convention), so distinct pieces
never share a string (as keys of completions' top_logprobs they would overwrite each other).

A token's text offset is the character index in the response text where its
contribution starts: the number of characters completed by the tokens before it,
counted over the whole request (stream chunks continue it). A token inside a
multi-byte character points at that character; a token that breaks an incomplete
character points after the U+FFFD the text shows for it. Example, text "f\\uf043 x\\ufffd y":

    tokens  "f"  EF  81  83  " x"  E6  " y"    (U+F043 = EF 81 83; E6 alone is invalid)
    offsets  0    1   1   1   2     4   5
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import decoders

from replica.outputs import RequestOutput, TopLogprobs

LOGPROB_FLOOR = -9999.0
"""What a logprob of -inf is sent as (vLLM's clamp; JSON has no infinity): a prompt
token's, or a top token a structured output's grammar forbids (`replica.structured`)."""


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: vocab character -> the byte it stands for.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes, in order, are
    shifted to U+0100.. (so 0x20, space, is 'Ġ' U+0120).
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(0x100 + i): b for i, b in enumerate(shifted)})
    return table


_BYTE_DECODER = _byte_decoder()


@dataclass(frozen=True)
class TokenInfo:
    """One vocabulary entry as responses show it.

    text: the token decoded alone; "bytes:\\xNN..." when its raw bytes are not UTF-8 alone.
    raw: the bytes it contributes to the text.
    in_text: False for special tokens, which the response text leaves out (unless the
        request turns skip_special_tokens off: `LogprobReader`).
    """

    text: str
    raw: bytes
    in_text: bool


class TokenTable:
    """Token id -> TokenInfo for one HF tokenizer, built on first use of each id.

    Raw bytes are exact for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen); for
    other tokenizers they are the UTF-8 of the token's decoded string.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._added = tokenizer.added_tokens_decoder
        self._byte_level = isinstance(tokenizer.backend_tokenizer.decoder, decoders.ByteLevel)
        self._cache: dict[int, TokenInfo] = {}

    def __getitem__(self, token_id: int) -> TokenInfo:
        info = self._cache.get(token_id)
        if info is None:
            info = self._cache[token_id] = self._describe(token_id)
        return info

    def _describe(self, token_id: int) -> TokenInfo:
        text = self.tokenizer.decode([token_id])
        added = self._added.get(token_id)
        if added is not None:
            return TokenInfo(text, added.content.encode(), not added.special)
        if not self._byte_level:
            return TokenInfo(text, text.encode(), True)
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        raw = bytes(_BYTE_DECODER[c] for c in piece)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return TokenInfo(text, raw, True)


@dataclass(frozen=True)
class Candidate:
    """A token with its logprob (the sampled one, or an alternative); an echoed prompt's
    first token has none (None)."""

    token: str
    raw: bytes
    logprob: float | None


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled position: the sampled token, its text offset, the most likely tokens."""

    sampled: Candidate
    text_offset: int
    top: tuple[Candidate, ...]


class LogprobReader:
    """Turns one request's engine outputs, in order, into TokenLogprob entries.

    specials_in_text: the request keeps special tokens in its text (skip_special_tokens
    off): their characters count in the offsets of the tokens after them."""

    def __init__(self, table: TokenTable, specials_in_text: bool = False):
        self.table = table
        self._specials = specials_in_text
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0

    def read(self, out: RequestOutput) -> list[TokenLogprob]:
        tops = out.new_top_logprobs or [()] * len(out.new_token_ids)
        rows = zip(out.new_token_ids, out.new_logprobs, tops, strict=True)
        return [self._entry(t, lp, top) for t, lp, top in rows]

    def read_prompt(
        self, ids: Sequence[int], out: RequestOutput, text: str, k: int
    ) -> list[TokenLogprob]:
        """The entries of an echoed prompt of ids, read before any generated token: the
        first token's logprob is None, the others' are out.prompt_logprobs, with at most
        k top tokens (the engine may have scored more, for prompt_logprobs). text: the
        echoed prompt, which the offsets point into; the generated tokens' run on from
        its end.

        A string prompt is echoed as sent, so a special token it spells ("<|user|>" in a
        chat-formatted prompt) is text there, while one the tokenizer added (a BOS) is
        not: a special token counts as text where the echo spells it at its offset."""
        lps = out.prompt_logprobs or []
        tops = out.prompt_top_logprobs or [()] * len(lps)
        rows = [(ids[0], None, ()), *zip(ids[1:], lps, tops, strict=True)]
        entries = [self._entry(t, lp, top[:k], text) for t, lp, top in rows]
        # the echo decoded the prompt on its own: a character it left incomplete shows as
        # U+FFFD there, and generated bytes cannot complete it
        self._utf8.reset()
        self._chars = len(text)
        return entries

    def _entry(
        self, token_id: int, logprob: float | None, top: TopLogprobs, echoed: str = ""
    ) -> TokenLogprob:
        """echoed: the echoed prompt when token_id is one of its tokens."""
        info, offset = self.table[token_id], self._chars
        # an echoed prompt shows a special token only where it spells it (the branch below)
        if (info.in_text or (self._specials and not echoed)) and info.raw:
            offset += self._breaks_pending_char(info.raw[0])
            self._chars += len(self._utf8.decode(info.raw))
        elif echoed and info.raw and echoed.startswith(info.text, offset):
            if not self._utf8.getstate()[0]:  # else the echo shows a U+FFFD here
                self._chars += len(info.text)
        return TokenLogprob(
            sampled=Candidate(info.text, info.raw, logprob),
            text_offset=offset,
            top=tuple(self._candidate(t, lp) for t, lp in top),
        )

    def _breaks_pending_char(self, first: int) -> bool:
        """Whether byte `first` cannot continue the incomplete character decoded so far
        (the text then shows that character as one U+FFFD before this token)."""
        pending = self._utf8.getstate()[0]
        if not pending:
            return False
        try:
            codecs.getincrementaldecoder("utf-8")().decode(pending + bytes([first]))
        except UnicodeDecodeError:
            return True
        return False

    def _candidate(self, token_id: int, logprob: float) -> Candidate:
        info = self.table[token_id]
        return Candidate(info.text, info.raw, max(logprob, LOGPROB_FLOOR))
