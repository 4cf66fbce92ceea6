"""Fixtures of the engine tests: rank-16 refs of the test adapters."""

from __future__ import annotations

import pytest

from replica.offline import adapter_ref


@pytest.fixture(scope="module")
def refs(llama_adapters):
    return {n: adapter_ref(n, p, max_rank=16) for n, p in llama_adapters.items()}
