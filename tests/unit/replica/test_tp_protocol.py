"""A STEP command round-trips: the worker's StepBatch carries the driver's inputs and the
rows whose logit shards it must compute (sample rows, prompt rows or None)."""

from __future__ import annotations

import pytest
import torch

from replica.layers.attention import AttentionMetadata, PrefillChunk
from replica.model_runner import StepBatch
from replica.tp_protocol import pack_step, step_payload_len, unpack_step


def _long(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


@pytest.mark.parametrize("prompt_rows", [None, [1, 2, 3]])
def test_step_round_trips_with_its_logit_rows(prompt_rows):
    # the docstring's example: one decode token, then a 3-token chunk ending its prompt
    meta = AttentionMetadata(
        slot_mapping=_long([13, 4, 5, 6]),
        num_decode=1,
        decode_block_tables=_long([[3]]),
        decode_context_lens=_long([5]),
        prefills=[PrefillChunk(1, 3, 3, _long([1, 2]))],
    )
    batch = StepBatch(
        input_ids=_long([9, 7, 8, 6]),
        positions=_long([4, 0, 1, 2]),
        lora_slots=_long([0, -1, -1, -1]),
        lora_count=1,
        meta=meta,
        sample_rows=_long([0, 3]),
        sample_seqs=[],
        prompt_rows=None if prompt_rows is None else _long(prompt_rows),
        prompt_targets=None if prompt_rows is None else _long([8, 6, 5]),
    )
    head, payload = pack_step(batch)
    h = head.tolist()
    assert h[1:9] == [4, 1, 1, 1, 2, 1, 2, len(prompt_rows or [])]
    assert payload.shape[0] == step_payload_len(h)
    got = unpack_step(h, payload, dense_prompt_min=77)
    for name in ("input_ids", "positions", "lora_slots", "sample_rows"):
        assert getattr(got, name).tolist() == getattr(batch, name).tolist(), name
    assert got.lora_count == 1 and got.prompt_targets is None
    assert (got.prompt_rows is None) == (prompt_rows is None)
    assert prompt_rows is None or got.prompt_rows.tolist() == prompt_rows
    assert got.meta.slot_mapping.tolist() == [13, 4, 5, 6]
    assert got.meta.dense_prompt_min == 77  # the worker's own setting
    assert got.meta.decode_block_tables.tolist() == [[3]]
    (chunk,) = got.meta.prefills
    assert (chunk.start, chunk.q_len, chunk.context_len) == (1, 3, 3)
    assert chunk.block_table.tolist() == [1, 2]
