"""A byte-level BPE tokenizer with a Llama-3-sized vocabulary (128k tokens of random
letters, digits, spaces and JSON punctuation) for benchmarks of the token masks of
structured outputs, whose cost grows with the vocabulary (the demo tokenizer has 384)."""

from __future__ import annotations

import random

CHARS = 'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 Ġ{}[]":,.'


def synthetic_tokenizer(size: int = 128000, seed: int = 0):
    """A transformers fast tokenizer of `size` tokens (the 256 byte symbols, random
    strings of 2-9 of CHARS, and "<|endoftext|>" as EOS, the last id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    while len(vocab) < size - 1:
        vocab.setdefault("".join(rng.choice(CHARS) for _ in range(rng.randint(2, 9))), len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
