"""Incremental detokenization: streamed text never holds a piece of a stop string, also
when the stop string ends in a character whose bytes arrive over several tokens."""

from __future__ import annotations

import random

import pytest

from replica.detokenizer import Detokenizer
from replica.sampling_params import SamplingParams
from replica.sequence import Sequence


class _BytesTokenizer:
    """Token id -> raw bytes; decode joins them and replaces incomplete UTF-8 by U+FFFD
    (what byte-level BPE tokenizers do)."""

    def __init__(self, pieces: dict[int, bytes]):
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def _stream(detok: Detokenizer, ids: list[int], stop: tuple[str, ...]) -> tuple[str, bool]:
    """Feed ids one by one as the engine does -> (streamed text, whether a stop hit)."""
    seq = Sequence("r", 0, [], SamplingParams(max_tokens=len(ids), stop=stop), None, 0)
    text = ""
    for i, token in enumerate(ids):
        seq.tokens.append(token)
        new, hit = detok.update(seq, final=i == len(ids) - 1)
        text += new
        if hit:
            return text, True
    return text, False


@pytest.mark.parametrize(
    ("ids", "stop", "expected"),
    [
        ([1, 2, 3], ("bé",), ("a", True)),  # "ab" + half of é: "b" must stay held back
        ([1, 2, 3], ("é",), ("ab", True)),
        ([1, 2, 3], ("bx",), ("abéx", False)),
        ([2, 3, 1], ("éx",), ("", True)),
    ],
)
def test_stop_string_ending_in_a_split_character(ids, stop, expected):
    # "é" is c3 a9: token 2 carries its first byte, token 3 the second (and "x")
    detok = Detokenizer(_BytesTokenizer({1: b"ab", 2: b"\xc3", 3: b"\xa9x"}))
    assert _stream(detok, ids, stop) == expected


def test_stop_token_text_is_left_out():
    """A request ended by a stop token id (or EOS) streams the text before that token,
    as vLLM does without include_stop_str_in_output; even text held back for a stop
    string is released."""
    detok = Detokenizer(_BytesTokenizer({1: b"ab", 2: b"\xc3", 3: b"\xa9x", 4: b"</s>"}))
    seq = Sequence("r", 0, [], SamplingParams(max_tokens=4, stop=("bz",)), None, 0)
    seq.tokens.append(1)
    assert detok.update(seq, final=False) == ("a", False)
    seq.tokens.append(4)
    assert detok.update(seq, final=True, stop_token=True) == ("b", False)
    assert seq.text == "ab"


def test_streamed_text_is_the_text_before_the_first_stop(llama_dir):
    """Random token ids of the tiny byte-level tokenizer (split characters are common)
    and stop strings cut from their own text: the streamed text is exactly the final
    text up to the first stop string, never more."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    detok, rng = Detokenizer(tok), random.Random(0)
    for _ in range(400):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 10))]
        full = tok.decode(ids, skip_special_tokens=True)
        a = rng.randrange(len(full) + 1)
        stop = full[a : a + rng.randint(1, 4)]
        if not stop or "\ufffd" in stop:
            continue
        text, hit = _stream(detok, ids, (stop,))
        assert hit and text == full[: full.find(stop)], (ids, stop)
