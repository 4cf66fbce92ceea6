"""Incremental detokenization with stop strings.

Each sequence's output ids go through a `tokenizers.decoders.DecodeStream`, which decodes
only a short window of the newest ids per step (vLLM's incremental scheme, in Rust): a
step costs the same at the 10th and the 10,000th token. Decoding the whole output every
step, as this module did before, cost 4.5 / 14.8 / 54.5 ms per step at 128 sequences of
128 / 512 / 2048 output tokens on a 2-core CPU, against 0.45-0.53 ms now and an 18.6 ms
H100 decode step (`benchmarks/detokenizer_cpu.py`, `results/detokenizer_cpu.json`). The stream holds back ids that end inside a multi-byte character until
it completes; at the request's end they are flushed as a full decode shows them
(U+FFFD). Each stream is primed with the prompt's last tokens, as vLLM does, so the text
is what the output ids add to the prompt's text: for byte-level BPE one decode of the
output ids, for sentencepiece-style decoders (which drop a text's first space) with the
completion's first space kept. Special tokens are skipped unless the request's
`skip_special_tokens` is off (its streams then spell them, as decode(skip_special_tokens=
False) does), and HF's `clean_up_tokenization_spaces` is not applied (it rewrites " ." as
"." and would disagree with the tokens' own bytes that logprobs report; vLLM does not
apply it either).

What is streamed also holds back any suffix that could still grow into a stop string,
unless the request keeps its stop string (`include_stop_str_in_output`, vLLM's): the text
then ends at the end of the first stop string to complete, after what was streamed.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from replica.sequence import Sequence


def _holdback(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


def _first_stop(text: str, old: int, stops: tuple[str, ...]) -> int:
    """Where the first stop string that ends after text[:old] starts (-1: none). Only
    those ending in the new text count, as in vLLM: one the output completed while below
    min_tokens (when none is looked for) must not end the request later."""
    found = (text.find(s, max(0, old - len(s) + 1)) for s in stops)
    return min((i for i in found if i >= 0), default=-1)


def _first_stop_end(text: str, old: int, stops: tuple[str, ...]) -> int:
    """Where the first stop string to complete after text[:old] ends (-1: none): the text
    kept with include_stop_str_in_output. Example: "xabcd" with stops ("abcd", "bc") and
    old 1 -> 4 ("xabc": "bc" completes first)."""
    ends = (text.find(s, max(0, old - len(s) + 1)) for s in stops)
    return min((i + len(s) for i, s in zip(ends, stops, strict=True) if i >= 0), default=-1)


PROMPT_CONTEXT = 4
"""Prompt tokens a sequence's stream is primed with (`Detokenizer._stream`)."""


class Detokenizer:
    """tokenizer: a HF fast tokenizer (its `backend_tokenizer` drives the streams)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer

    def update(self, seq: Sequence, final: bool, stop_token: bool = False) -> tuple[str, bool]:
        """Decode seq's new output ids; returns (new text to emit, whether a stop string
        matched).

        stop_token: the last token ended the request (a stop_token_id or EOS); its text
        is left out of the output, as vLLM does without include_stop_str_in_output (the
        id stays in the token ids), and kept with it.
        """
        p = seq.params
        end = seq.num_output
        if stop_token and not p.include_stop_str_in_output:
            end -= 1
        text = seq.text + self._decode_new(seq, end, final)
        stops = p.stop
        hit = False
        if stops and seq.num_output >= p.min_tokens:  # none looked for before
            find = _first_stop_end if p.include_stop_str_in_output else _first_stop
            cut = find(text, len(seq.text), stops)
            if cut >= 0:
                text, hit, final = text[:cut], True, True
        seq.text = text
        end_at = len(text)
        if not final and stops and not p.include_stop_str_in_output:
            # "ab" with half of an "é" pending may end in a stop string "bé" once the é
            # completes, so "b" must be held back too. A kept stop string ends after
            # what was streamed: nothing needs holding back.
            end_at -= _holdback(text, stops)
        new = text[seq.emitted_text_len : end_at] if end_at > seq.emitted_text_len else ""
        seq.emitted_text_len = max(seq.emitted_text_len, end_at)
        return new, hit

    def _stream(self, seq: Sequence) -> DecodeStream:
        """seq's stream, made on first use and primed with the prompt's last
        PROMPT_CONTEXT tokens (their text discarded), as vLLM seeds its detokenizer: a
        sentencepiece-style decoder drops the space of a text's first word, so decoded
        alone "▁world" after the prompt "Hello" read "world", not " world". A prompt
        ending inside a character gives no clean context: its stream starts unprimed."""
        if seq.detok_stream is None:
            tail = seq.tokens[max(0, seq.prompt_len - PROMPT_CONTEXT) : seq.prompt_len]
            seq.detok_stream = self._primed(tail, seq.params.skip_special_tokens)
        return seq.detok_stream

    def _primed(self, tail: list[int], skip: bool) -> DecodeStream:
        """A stream that has decoded tail (its text discarded); unprimed when tail's text
        ends inside a character (U+FFFD) or the decoder refuses the window. skip: the
        request's skip_special_tokens (vLLM primes with it too)."""
        stream = DecodeStream(skip_special_tokens=skip)
        if not tail or self._backend.decode(tail, skip_special_tokens=skip).endswith("\ufffd"):
            return stream
        try:
            for token in tail:
                stream.step(self._backend, token)
        except Exception:  # noqa: BLE001 - see _decode_new: a decoder not prefix-stable
            return DecodeStream(skip_special_tokens=skip)
        return stream

    def _decode_new(self, seq: Sequence, end: int, final: bool) -> str:
        """The text of output ids [seq.detok_fed, end) that is complete now (all of it
        when final)."""
        stream = self._stream(seq)
        pieces = []
        for i in range(seq.detok_fed, end):
            try:
                piece = stream.step(self._backend, seq.tokens[seq.prompt_len + i])
            except Exception:  # noqa: BLE001 - a decoder whose text is not prefix-stable
                # Rust's stream refuses a window whose text does not extend its prefix; go
                # on from here with a fresh stream (without the context of earlier ids)
                skip = seq.params.skip_special_tokens
                seq.detok_stream = stream = DecodeStream(skip_special_tokens=skip)
                piece = self._decode(seq, seq.detok_settled, i + 1)
            if piece is not None:
                pieces.append(piece)
                seq.detok_settled = i + 1
        seq.detok_fed = max(seq.detok_fed, end)
        if final and seq.detok_settled < end:
            pieces.append(self._decode(seq, seq.detok_settled, end))
            seq.detok_settled = end
        return "".join(pieces)

    def _decode(self, seq: Sequence, start: int, end: int) -> str:
        """Output ids [start, end) decoded at once, as the streams decode."""
        ids = seq.tokens[seq.prompt_len + start : seq.prompt_len + end]
        return self._backend.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)
