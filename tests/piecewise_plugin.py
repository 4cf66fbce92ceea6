"""A pytest plugin that runs every CPU engine the tests build through the piecewise
mixed-step graphs (`replica.mixed_graphs.MixedGraphs` without capture), so the whole
engine suite checks the pieces' buffers and padding, not only test_mixed_graphs.py:

    .venv/bin/python -m pytest -p tests.piecewise_plugin tests/unit/replica \\
        --deselect tests/unit/replica/test_triton_wiring.py::test_stacked_decode_shrinks_in_the_engine_equal_reference

That deselected test asserts that a 3-token decode step takes one tile plan; padded to
an 8-row bucket it takes another (its tokens still equal the reference's). Not part of
CI's run (it repeats the replica suite, ~5 minutes); run it after changing the pieces.
"""

from __future__ import annotations

import replica.engine_setup as engine_setup
from replica.mixed_graphs import MixedGraphs

_graphs = engine_setup._graphs
_engines = [0]


def _with_cpu_pieces(config, model, kv, ctx, num_blocks, max_len):
    decode, mixed = _graphs(config, model, kv, ctx, num_blocks, max_len)
    if mixed is None:
        _engines[0] += 1
        mixed = MixedGraphs(model, kv, ctx, config.max_num_batched_tokens, capture=False)
    return decode, mixed


engine_setup._graphs = _with_cpu_pieces


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"engines run through CPU piecewise graphs: {_engines[0]}")
