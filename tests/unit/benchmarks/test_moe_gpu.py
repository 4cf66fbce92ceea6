"""benchmarks/moe_gpu.py's shape table, routing, floor and sweep plan on the CPU: the floor
counts the experts the routing touches (byte counts written out here), the dense path
is skipped only past its row limit, the sweep's tiles fit sm_90's shared memory as
Triton compiled them (numbers from compiling for sm_90 with Triton 3.9) and stay inside
the 4-minute estimate, and bad flags are refused before anything runs."""

from __future__ import annotations

import sys

import pytest
import torch

from benchmarks import moe_gpu
from benchmarks.moe_shapes import (
    SHAPES,
    block_heights,
    dense_skip,
    floor_bytes,
    gate_up_configs,
    gemm_tile,
    routing,
    sweep_plan,
)
from kernels.triton.fused_moe import GemmConfig


def _main(monkeypatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", ["moe_gpu.py", *args])
    moe_gpu.main()


def test_shape_table():
    dims = {n: (s.hidden, s.inter, s.experts, s.top_k, s.normalize) for n, s in SHAPES.items()}
    assert dims == {
        "mixtral": (4096, 14336, 8, 2, True),
        "qwen3-moe": (2048, 768, 128, 8, True),
        "qwen2-moe": (2048, 1408, 60, 4, False),
    }
    assert SHAPES["mixtral"].tokens == (1, 8, 32, 128, 512)
    assert SHAPES["qwen3-moe"].tokens == SHAPES["qwen2-moe"].tokens == (1, 8, 32, 128, 512, 2048)


@pytest.mark.parametrize(
    ("name", "tokens", "touched"),
    [("mixtral", 1, 2), ("qwen3-moe", 1, 8), ("qwen2-moe", 1, 4), ("qwen3-moe", 2048, 128)],
)
def test_floor_counts_the_experts_routing_touches(name, tokens, touched):
    shape = SHAPES[name]
    w, ids = routing(shape, tokens, torch.Generator().manual_seed(0))
    expert = {"mixtral": 3 * 14336 * 4096 * 2, "qwen3-moe": 3 * 768 * 2048 * 2,
              "qwen2-moe": 3 * 1408 * 2048 * 2}[name]  # fmt: skip
    x_y = 2 * tokens * shape.hidden * 2
    assert floor_bytes(shape, tokens, ids) == {"experts_touched": touched, "bytes": touched * expert + x_y}  # fmt: skip
    assert ids.shape == w.shape == (tokens, shape.top_k)


def test_routing_renormalises_where_the_model_does():
    gen = torch.Generator().manual_seed(0)
    w3, ids3 = routing(SHAPES["qwen3-moe"], 64, gen)
    w2, _ = routing(SHAPES["qwen2-moe"], 64, gen)
    torch.testing.assert_close(w3.sum(-1), torch.ones(64))
    assert (w2.sum(-1) < 0.99).all()  # 4 of 60 softmax weights, not renormalised
    assert all(len(set(row)) == 8 for row in ids3.tolist())


@pytest.mark.parametrize(
    ("name", "tokens", "skipped"),
    [("mixtral", 512, False), ("qwen3-moe", 512, False), ("qwen3-moe", 2048, True),
     ("qwen2-moe", 1024, False), ("qwen2-moe", 2048, True)],
)  # fmt: skip
def test_dense_skipped_past_its_row_limit(name, tokens, skipped):
    reason = dense_skip(SHAPES[name], tokens)
    assert (reason is not None) == skipped
    if skipped:
        assert reason.startswith(f"E x T = {SHAPES[name].experts * tokens} expert rows > 65536")


@pytest.mark.parametrize(
    ("tokens", "heights"),
    [(1, [16]), (128, [16]), (256, [16, 32]), (512, [16, 32, 64]), (2048, [16, 32, 64, 128])],
)
def test_block_heights_follow_rows_per_expert(tokens, heights):
    assert block_heights(SHAPES["qwen3-moe"], tokens) == heights  # T / 16 rows an expert


def test_mixtral_sweep_tiles_are_the_earlier_ones():
    at16 = [c.gate_up for c in gate_up_configs(SHAPES["mixtral"], 128, 16)]
    at128 = [c.gate_up for c in gate_up_configs(SHAPES["mixtral"], 128, 128)]
    assert at16 == [GemmConfig(64, 128, 4, 4), GemmConfig(128, 64, 8, 4), GemmConfig(64, 64, 4, 4)]
    assert at128 == [GemmConfig(64, 128, 8, 3), GemmConfig(128, 64, 8, 3), GemmConfig(64, 64, 8, 3)]


@pytest.mark.parametrize(
    ("tile", "stages"),
    [
        ((16, 64, 256, 2), 4),  # 3 buffers of 72 KB: 221184 B compiled
        ((16, 128, 256, 2), 2),  # 1 buffer: 139264 B
        ((64, 64, 128, 2), 4),  # wgmma, 4 buffers: 196608 B
        ((64, 128, 128, 2), 2),  # at 3 stages Triton asked 245760 B
        ((64, 64, 256, 1), 3),  # at 4: 262144 B
        ((64, 128, 256, 2), None),  # 2 stages: 327680 B
        ((128, 128, 256, 1), None),  # 2 stages: 262144 B
    ],
)
def test_stages_fit_sm90_shared_memory(tile, stages):
    cfg = gemm_tile(*tile)
    assert (cfg and cfg.num_stages) == stages


def test_sweep_plan_counts_and_estimate():
    # qwen3-moe T=128: 16-row blocks only; 9 gate_up tiles, 6 down tiles, moe_config's
    # down tile (128, 64, 8 warps, 4 stages) among the latter
    one = sweep_plan(SHAPES["qwen3-moe"], [128])
    assert (one["timings"], one["compiles"]) == (15, 15)
    for shape in SHAPES.values():
        assert sweep_plan(shape, list(shape.tokens))["estimate_s"] < 240


def test_dry_run_prints_the_plan_without_a_gpu(monkeypatch, capsys):
    _main(monkeypatch, "--shape", "qwen3-moe", "--sweep", "--dry-run")
    out = capsys.readouterr().out
    assert "T 128: 8 rows an expert; sweep block heights 16\n" in out
    assert "T 2048: 128 rows an expert; sweep block heights 16, 32, 64, 128; dense skipped" in out
    assert f"sweep: {sweep_plan(SHAPES['qwen3-moe'], [1, 8, 32, 128, 512, 2048])['timings']} timings" in out  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--shape", "llama"], "argument --shape: invalid choice: 'llama'"),
        (["--tokens", "1,0"], "--tokens '1,0': allowed: comma-separated token counts >= 1"),
    ],
)
def test_refused_flags(monkeypatch, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        _main(monkeypatch, *args, "--dry-run")
    assert exc.value.code == 2 and message in capsys.readouterr().err
