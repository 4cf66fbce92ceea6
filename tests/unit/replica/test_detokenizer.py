"""Incremental detokenization: streamed text never holds a piece of a stop string, also
when the stop string ends in a character whose bytes arrive over several tokens."""

from __future__ import annotations

import functools
import random

import pytest

from replica.detokenizer import Detokenizer
from replica.sampling_params import SamplingParams
from replica.sequence import Sequence


def _byte_tokenizer(words: tuple[bytes, ...]):
    """A byte-level BPE fast tokenizer whose vocabulary is the 256 bytes, `words` (each
    merged from its bytes, in order) and the special token "</s>"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_char = {b: c for c, b in _byte_decoder().items()}
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    merges = []
    for w in words:
        chars = [byte_char[b] for b in w]
        for i in range(1, len(chars)):
            left, right = "".join(chars[:i]), chars[i]
            merges.append((left, right))
            vocab.setdefault(left + right, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    return fast


def _byte_decoder() -> dict[str, int]:
    from router.logprobs import _BYTE_DECODER

    return _BYTE_DECODER


def _ids(tok, pieces: tuple[bytes, ...]) -> list[int]:
    """The token id of each piece's bytes (a vocabulary entry)."""
    char = {b: c for c, b in _byte_decoder().items()}
    return [tok.convert_tokens_to_ids("".join(char[b] for b in p)) for p in pieces]


def _stream(
    detok: Detokenizer, ids: list[int], stop: tuple[str, ...], **params
) -> tuple[str, bool]:
    """Feed ids one by one as the engine does -> (streamed text, whether a stop hit);
    params: more SamplingParams fields."""
    seq = Sequence("r", 0, [], SamplingParams(max_tokens=len(ids), stop=stop, **params), None, 0)
    text, hit = "", False
    for i, token in enumerate(ids):
        seq.tokens.append(token)
        new, hit = detok.update(seq, final=i == len(ids) - 1)
        text += new
        if hit:
            break
    if params.get("include_stop_str_in_output"):
        assert text == seq.text  # what was streamed is the whole text
    return text, hit


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
    tok = _byte_tokenizer((b"ab", b"\xa9x"))
    token = dict(zip((1, 2, 3), _ids(tok, (b"ab", b"\xc3", b"\xa9x")), strict=True))
    assert _stream(Detokenizer(tok), [token[i] for i in ids], stop) == expected


def test_stop_token_text_is_left_out():
    """A request ended by a stop token id (or EOS) streams the text before that token,
    as vLLM does without include_stop_str_in_output; even text held back for a stop
    string is released."""
    tok = _byte_tokenizer((b"ab",))
    detok = Detokenizer(tok)
    seq = Sequence("r", 0, [], SamplingParams(max_tokens=4, stop=("bz",)), None, 0)
    seq.tokens += _ids(tok, (b"ab",))
    assert detok.update(seq, final=False) == ("a", False)
    seq.tokens.append(tok.convert_tokens_to_ids("</s>"))
    assert detok.update(seq, final=True, stop_token=True) == ("b", False)
    assert seq.text == "ab"


@pytest.mark.parametrize("keep", [False, True], ids=["stop-left-out", "stop-kept"])
def test_streamed_text_is_the_text_before_the_first_stop(llama_dir, keep):
    """Random token ids of the tiny byte-level tokenizer (split characters are common)
    and stop strings cut from their own text: the streamed text is exactly the final
    text up to the first stop string (through it, when kept), never more."""
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
        text, hit = _stream(detok, ids, (stop,), include_stop_str_in_output=keep)
        assert hit and text == full[: full.find(stop) + (len(stop) if keep else 0)], (ids, stop)


def _sentencepiece_tokenizer():
    """A Llama-2-style fast tokenizer (what HF converts sentencepiece models to): "▁" for
    spaces, <0xNN> byte-fallback tokens, and a decoder that strips the text's first
    space, so a window's text depends on where the window starts."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    merges = []
    for word in ("▁the", "▁hello", "lo", "▁é", "▁a"):
        for ch in word:
            vocab.setdefault(ch, len(vocab))
        for i in range(2, len(word) + 1):
            merges.append((word[: i - 1], word[i - 1]))
            vocab.setdefault(word[:i], len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _random_ids(tok, rng: random.Random, kind: str) -> list[int]:
    """Up to 40 random ids. Byte-level: any. Sentencepiece: word pieces, special tokens
    and <0xNN> runs that spell whole characters (ByteFallback decodes a run that is not
    valid UTF-8 as one U+FFFD per byte, valid bytes included, so one decode of such a run
    is no concatenation of its pieces' texts; streams keep the valid bytes)."""
    if kind == "byte-level":
        return [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
    ids: list[int] = []
    while len(ids) < rng.randint(1, 40):
        if rng.random() < 0.3:
            char = rng.choice("aé€😀\n")
            ids += [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in char.encode()]
        else:
            ids.append(rng.choice([0, 1, 2, *range(259, len(tok))]))
    return ids


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_streamed_text_equals_one_decode_of_all_ids(llama_dir, kind, skip):
    """Random ids (split characters, byte-fallback pieces, special tokens), fed one per
    step: the streamed text is what the output ids add to the text of the prompt's last
    tokens, special tokens skipped or (skip_special_tokens off) spelled (for byte-level
    BPE: one decode of the output ids); a last stop token is left out."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_dir)) if kind == "byte-level" else None
    tok = tok or _sentencepiece_tokenizer()
    detok, rng = Detokenizer(tok), random.Random(1)
    decode = functools.partial(tok.backend_tokenizer.decode, skip_special_tokens=skip)
    for _ in range(300):
        ids = _random_ids(tok, rng, kind)
        stop_token = rng.random() < 0.3
        if stop_token and kind == "sentencepiece":  # ending no run in half a character
            ids.append(tok.eos_token_id)
        prompt = _random_ids(tok, rng, kind)[:6] if kind == "sentencepiece" else [7, 8]
        if "\ufffd" in decode(prompt[-4:]):
            prompt = [259]  # a word piece: the prompt's text ends in a whole character
        params = SamplingParams(max_tokens=len(ids), skip_special_tokens=skip)
        seq = Sequence("r", len(prompt), list(prompt), params, None, 0)
        text = ""
        for i, token in enumerate(ids):
            seq.tokens.append(token)
            last = i == len(ids) - 1
            text += detok.update(seq, final=last, stop_token=last and stop_token)[0]
        kept = ids[:-1] if stop_token else ids
        # vLLM's text: what the output adds to the text of the prompt's last tokens
        context = decode(prompt[-4:])
        whole = decode(prompt[-4:] + kept)
        assert whole.startswith(context) and text == whole[len(context) :], (prompt, ids)


def test_a_long_output_streams_exactly_its_whole_decode(llama_dir):
    """3000 random ids (split characters and special tokens throughout), one per step:
    the streamed text is the whole output decoded at once."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    ids = [random.Random(2).randrange(len(tok)) for _ in range(3000)]
    text, hit = _stream(Detokenizer(tok), ids, ())
    assert not hit and text == tok.backend_tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_token_after_a_split_character_keeps_its_text_out():
    """vLLM's stop-token rule with a character completed over two tokens: the bytes before
    the stop token are text, the stop token is not."""
    tok = _byte_tokenizer((b"ab", b"\xa9x"))
    ab, c3, a9x = _ids(tok, (b"ab", b"\xc3", b"\xa9x"))
    detok = Detokenizer(tok)
    seq = Sequence("r", 0, [], SamplingParams(max_tokens=5), None, 0)
    got = []
    for token in (ab, c3, a9x):
        seq.tokens.append(token)
        got.append(detok.update(seq, final=False)[0])
    seq.tokens.append(tok.convert_tokens_to_ids("</s>"))
    got.append(detok.update(seq, final=True, stop_token=True)[0])
    assert got == ["ab", "", "\u00e9x", ""] and seq.text == "ab\u00e9x"


@pytest.mark.parametrize(
    ("min_tokens", "expected"),
    [
        (4, ("xabcd", False)),  # "ab" ended at token 3, before min_tokens: never looked for
        (3, ("x", True)),  # "ab" ends at token 3 = min_tokens: it stops there
    ],
)
def test_a_stop_string_ended_below_min_tokens_is_not_found_later(min_tokens, expected):
    """vLLM looks for a stop string only where it ends in the step's new text: one that
    the output completed while below min_tokens does not end the request once
    min_tokens is reached (it ended it then, after streaming the stop string)."""
    tok = _byte_tokenizer(())
    ids = _ids(tok, (b"x", b"a", b"b", b"c", b"d"))
    seq = Sequence(
        "r", 0, [], SamplingParams(max_tokens=5, stop=("ab",), min_tokens=min_tokens), None, 0
    )
    detok, text = Detokenizer(tok), ""
    for i, token in enumerate(ids):
        seq.tokens.append(token)
        new, hit = detok.update(seq, final=i == len(ids) - 1)
        text += new
        if hit:
            break
    assert (text, hit) == expected and seq.text == text


def test_a_sentencepiece_completion_keeps_its_first_space():
    """After the prompt "hello", the output "▁the" reads " the" (vLLM's text; decoded
    alone, the decoder's first-space strip made it "the", so prompt + completion read
    "hellothe")."""
    tok = _sentencepiece_tokenizer()
    hello, the = tok.convert_tokens_to_ids(["▁hello", "▁the"])
    seq = Sequence("r", 2, [tok.bos_token_id, hello], SamplingParams(max_tokens=2), None, 0)
    seq.tokens += [the, the]
    assert Detokenizer(tok).update(seq, final=True) == (" the the", False)


def _stream_kept(detok: Detokenizer, ids: list[int], stop: tuple[str, ...], **params):
    """`_stream` with include_stop_str_in_output."""
    return _stream(detok, ids, stop, include_stop_str_in_output=True, **params)


@pytest.mark.parametrize(
    ("ids", "stop", "expected"),
    [
        ([1, 2, 3], ("bé",), ("abé", True)),  # the é completes over two tokens
        ([1, 2, 3], ("é",), ("abé", True)),
        ([1, 2, 3], ("bx",), ("abéx", False)),
        ([2, 3, 1], ("éx",), ("éx", True)),
        ([1, 3], ("b",), ("ab", True)),  # the rest of the token after the stop is cut
    ],
)
def test_a_kept_stop_string_ends_the_text(ids, stop, expected):
    tok = _byte_tokenizer((b"ab", b"\xa9x"))
    token = dict(zip((1, 2, 3), _ids(tok, (b"ab", b"\xc3", b"\xa9x")), strict=True))
    assert _stream_kept(Detokenizer(tok), [token[i] for i in ids], stop) == expected


def test_a_kept_stop_string_is_the_first_to_complete():
    """Of stop strings completing in one step, the text ends at the first to end (a
    character-by-character stream would have met it first), not at the first to start."""
    tok = _byte_tokenizer((b"xabcd",))
    ids = _ids(tok, (b"xabcd",))
    assert _stream_kept(Detokenizer(tok), ids, ("abcd", "bc")) == ("xabc", True)


@pytest.mark.parametrize(
    ("keep", "skip", "expected"),
    [
        (False, True, "ab"),
        (True, True, "ab"),  # EOS is a special token: its text is ""
        (False, False, "ab"),  # the stop token's text is left out, special or not
        (True, False, "ab</s>"),
    ],
)
def test_a_kept_stop_token_is_text(keep, skip, expected):
    """vLLM: with include_stop_str_in_output the token that ended the request is
    detokenized too (EOS spells "" unless special tokens are kept)."""
    tok = _byte_tokenizer((b"ab",))
    params = SamplingParams(
        max_tokens=4, stop=("bz",), include_stop_str_in_output=keep, skip_special_tokens=skip
    )
    seq = Sequence("r", 0, [], params, None, 0)
    seq.tokens += [*_ids(tok, (b"ab",)), tok.convert_tokens_to_ids("</s>")]
    new, hit = Detokenizer(tok).update(seq, final=True, stop_token=True)
    assert (new, hit, seq.text) == (expected, False, expected)


def test_a_kept_stop_token_id_of_plain_text_is_text():
    tok = _byte_tokenizer((b"ab", b"cd"))
    ab, cd = _ids(tok, (b"ab", b"cd"))
    for keep, expected in ((False, "ab"), (True, "abcd")):
        params = SamplingParams(max_tokens=2, stop_token_ids=(cd,), include_stop_str_in_output=keep)
        seq = Sequence("r", 0, [ab, cd], params, None, 0)
        assert Detokenizer(tok).update(seq, final=True, stop_token=True) == (expected, False)
