"""benchmarks/mixed_step_gpu.py on the CPU (--smoke): its steps are what they say (decode
tokens at their context, a prompt chunk, adapters), the piecewise runner replays them
with the eager runner's logits, and bad --shapes are refused."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import mixed_step_gpu
from benchmarks.engine_shapes import LLAMA3_8B, SMOKE
from replica.models.config import ModelConfig


def test_smoke_run_writes_rows_with_their_floor(tmp_path):
    out = tmp_path / "m.json"
    mixed_step_gpu.main(["--smoke", "--layers", "2", "--steps", "1", "--warmup", "0",
                         "--context", "20", "--shapes", "3+10,0+9", "--out", str(out)])  # fmt: skip
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [(r["decode_tokens"], r["prompt_chunk_tokens"], r["distinct_adapters"]) for r in rows] == [
        (3, 10, 0), (3, 10, 3), (0, 9, 0), (0, 9, 1)]  # fmt: skip
    for r in rows:
        assert r["token_bucket"] >= r["tokens"]
        assert r["logits_max_abs_diff"] == 0.0  # CPU: the same ops, uncaptured
        base = next(b for b in rows if b["tokens"] == r["tokens"] and not b["distinct_adapters"])
        assert r["floor_eager_base_ms"] == base["eager_ms"]


def test_batch_layout():
    cfg = ModelConfig.from_hf({**LLAMA3_8B, **SMOKE, "num_hidden_layers": 1})
    b = mixed_step_gpu.make_batch(cfg, 3, 20, 40, 2, torch.device("cpu"))
    assert b.input_ids.shape == (23,) and b.lora_slots.tolist() == [0, 1, 0] + [0] * 20
    assert b.lora_count == 2 and b.sample_rows.tolist() == [0, 1, 2, 22]
    assert b.positions.tolist() == [40] * 3 + list(range(20))
    m = b.meta
    assert m.decode_context_lens.tolist() == [41] * 3
    per_seq = 3  # 41 tokens in 16-token blocks
    assert m.slot_mapping[:3].tolist() == [(i * per_seq + 2) * 16 + 8 for i in range(3)]
    chunk = m.prefills[0]
    assert (chunk.start, chunk.q_len, chunk.context_len) == (3, 20, 20)
    assert chunk.block_table.tolist() == [9, 10]
    assert m.slot_mapping[3:].tolist() == list(range(9 * 16, 9 * 16 + 20))
    assert len(set(m.slot_mapping.tolist())) == 23  # no two tokens share a KV slot


@pytest.mark.parametrize("shapes", ["3x10", "0+0", "-1+4", "3+4+5"])
def test_bad_shapes_are_refused(shapes, capsys):
    with pytest.raises(SystemExit):
        mixed_step_gpu.parse_args(["--shapes", shapes])
    assert "--shapes" in capsys.readouterr().err


def test_steps_past_the_graph_buckets_are_eager_rows(tmp_path, monkeypatch):
    """A step larger than the piecewise graphs' largest bucket (2048 tokens) is timed
    eagerly only, as the engine runs it; --dense-prompt-min reaches the steps' metadata."""
    seen, real = [], mixed_step_gpu.make_batch

    def spy(*a):
        batch = real(*a)
        seen.append(batch.meta)
        return batch

    monkeypatch.setattr(mixed_step_gpu, "make_batch", spy)
    out = tmp_path / "m.json"
    mixed_step_gpu.main(["--smoke", "--layers", "1", "--steps", "1", "--warmup", "0",
                         "--shapes", "0+2100", "--dense-prompt-min", "0", "--out", str(out)])  # fmt: skip
    doc = json.loads(out.read_text())
    assert doc["dense_prompt_min"] == 0
    assert seen and {m.dense_prompt_min for m in seen} == {0}
    assert [r["distinct_adapters"] for r in doc["rows"]] == [0, 1]
    for r in doc["rows"]:
        assert r["tokens"] == 2100 and "graphs_ms" not in r and "token_bucket" not in r
        ratio = r["eager_ms"] / r["floor_eager_base_ms"]  # of the rounded figures
        assert r["eager_vs_floor"] == pytest.approx(ratio, abs=2e-3)
