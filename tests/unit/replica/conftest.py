"""Fixtures of the engine tests: rank-16 refs of the test adapters."""

from __future__ import annotations

import pytest

from replica.offline import adapter_ref
from replica.structured import Grammars


@pytest.fixture(scope="module")
def refs(llama_adapters):
    return {n: adapter_ref(n, p, max_rank=16) for n, p in llama_adapters.items()}


@pytest.fixture(scope="module")
def grammars(llama_dir):
    """Structured-output grammars over the tiny Llama's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    return Grammars(tok, len(tok), [tok.eos_token_id])
