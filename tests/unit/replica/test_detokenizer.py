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


class _CountingTokenizer:
    """A real tokenizer that counts the token ids it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_long_output_decodes_each_token_a_bounded_number_of_times(llama_dir, seed):
    """Each step decodes only the tokens since the last complete character (plus the
    step before, for context), not the whole output: decoding it all made a step cost
    grow with the output (O(n^2) per request; on this tiny tokenizer 1.5 ms a step per
    sequence at 8000 tokens, under the engine lock). The streamed text is still exactly
    the whole output decoded at once, split characters and special tokens included."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    counting, rng = _CountingTokenizer(tok), random.Random(seed)
    ids = [rng.randrange(len(tok)) for _ in range(3000)]
    text, hit = _stream(Detokenizer(counting), ids, ())
    assert not hit and text == tok.decode(ids, skip_special_tokens=True)
    assert counting.decoded < 8 * len(ids), counting.decoded


def test_stop_token_after_a_split_character_keeps_its_text_out():
    """The incremental decode keeps vLLM's stop-token rule: the bytes before the stop
    token (a character completed over three tokens) are text, the stop token is not."""
    detok = Detokenizer(_BytesTokenizer({1: b"ab", 2: b"\xc3", 3: b"\xa9x", 4: b"</s>"}))
    seq = Sequence("r", 0, [], SamplingParams(max_tokens=5), None, 0)
    got = []
    for token in (1, 2, 3):
        seq.tokens.append(token)
        got.append(detok.update(seq, final=False)[0])
    seq.tokens.append(4)
    got.append(detok.update(seq, final=True, stop_token=True)[0])
    assert got == ["ab", "", "\u00e9x", ""] and seq.text == "ab\u00e9x"


def _sentencepiece_like():
    """A Llama-2-style tokenizer: "▁" for spaces, byte fallback, and a decoder that
    strips the leading space of the first token it decodes."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    pieces = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["hello world the quick brown fox café naïve 日本語 🙂"] * 20, trainer)
    tok.add_tokens(pieces)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def test_windows_match_the_whole_decode_of_a_space_stripping_decoder():
    """With a decoder that strips the first decoded token's space, each window is read
    after a context token with text: a context of skipped special tokens ("</s>" under
    ignore_eos) decodes to nothing and would lose the space of the token after it."""
    tok = _sentencepiece_like()
    detok, rng = Detokenizer(tok), random.Random(0)
    special = [tok.convert_tokens_to_ids(t) for t in ("<s>", "</s>", "<unk>")]
    for _ in range(200):
        ids = [rng.choice(special) if rng.random() < 0.2 else rng.randrange(len(tok))
               for _ in range(rng.randint(1, 40))]  # fmt: skip
        assert _stream(detok, ids, ()) == (tok.decode(ids, skip_special_tokens=True), False), ids
