"""Prefill and mixed steps replayed from captured piecewise CUDA graphs
(`replica.mixed_graphs`): the real rows' hidden states equal the eager forward's with every
buffer's padding rows NaN, on a first (capturing) and a second run. The engine-level
check (tokens equal the CPU engine's, with these graphs replayed) is in
test_engine_cuda.py."""

from __future__ import annotations

import pytest

from tests.unit.replica.engines import small_engine
from tests.unit.replica.test_mixed_graphs import padded_step_equals_eager

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("model", ["llama", "mixtral"])
def test_captured_pieces_equal_eager_forward(request, model):
    model_dir = request.getfixturevalue(f"{model}_dir")
    adapters = request.getfixturevalue(f"{model}_adapters")
    engine = small_engine(model_dir, device="cuda")
    mixed = padded_step_equals_eager(engine, adapters, capture=True, tol=1e-4)
    assert not mixed.disabled and mixed.pool is not None
