"""Incremental detokenization with stop strings.

The text of a request is decoded from all of its output tokens; what is streamed
holds back (a) a trailing U+FFFD, which means a multi-byte character is not complete
yet, and (b) any suffix that could still grow into a stop string.
"""

from __future__ import annotations

from replica.sequence import Sequence

_INCOMPLETE = "\ufffd"


def _holdback(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def update(self, seq: Sequence, final: bool, stop_token: bool = False) -> tuple[str, bool]:
        """Decode seq's output; returns (new text to emit, whether a stop string matched).

        stop_token: the last token ended the request (a stop_token_id or EOS); its text
        is left out of the output, as vLLM does without include_stop_str_in_output (the
        id stays in the token ids).
        """
        ids = seq.output_ids[:-1] if stop_token else seq.output_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        stops = seq.params.stop
        hit = False
        if stops:
            start = max(0, len(seq.text) - max(len(s) for s in stops))
            cut = min((i for i in (text.find(s, start) for s in stops) if i >= 0), default=-1)
            if cut >= 0:
                text, hit, final = text[:cut], True, True
        seq.text = text
        end = len(text)
        if not final:
            while end > seq.emitted_text_len and text[end - 1] == _INCOMPLETE:
                end -= 1
            # After the incomplete character is set aside: "ab\ufffd" may end in a stop
            # string "bé" once é completes, so "b" must be held back too.
            end -= _holdback(text[:end], stops)
        new = text[seq.emitted_text_len : end] if end > seq.emitted_text_len else ""
        seq.emitted_text_len = max(seq.emitted_text_len, end)
        return new, hit
