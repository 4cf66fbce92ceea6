"""benchmarks/engine_gpu.py's shapes on the CPU (--smoke): a Mixtral-shaped run takes
its MoE path, adapters on q/k/v/o only, and an HBM floor that counts the experts a step
reaches in expectation (checked against byte counts written out here, and the
expectation against enumerating every routing); bad flag combinations are refused before
anything runs."""

from __future__ import annotations

import itertools
import json
import sys

import pytest
import torch

from benchmarks import engine_gpu
from benchmarks.engine_shapes import MIXTRAL_8X7B, SMOKE, expected_experts, step_weight_bytes
from replica.models.config import ModelConfig
from replica.models.llama import CausalLM
from replica.models.moe import SparseMoE

SMOKE_ARGS = ["--smoke", "--only", "4:0,4:2", "--steps", "2", "--prompt-len", "8", "--layers", "2"]


def _main(monkeypatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", ["engine_gpu.py", *args])
    engine_gpu.main()


@pytest.mark.parametrize(("experts", "top_k", "tokens"), [(8, 2, 1), (8, 2, 2), (8, 2, 3), (4, 1, 3), (4, 3, 2)])  # fmt: skip
def test_expected_experts_equals_enumeration(experts, top_k, tokens):
    choices = list(itertools.combinations(range(experts), top_k))
    routings = list(itertools.product(choices, repeat=tokens))
    mean = sum(len(set().union(*r)) for r in routings) / len(routings)
    assert expected_experts(experts, top_k, tokens) == pytest.approx(mean, rel=1e-12)


def test_step_weight_bytes_counts_the_experts_routing_reaches():
    with torch.device("meta"):
        moe = CausalLM(ModelConfig.from_hf({**MIXTRAL_8X7B, **SMOKE, "num_hidden_layers": 2}))
        dense = CausalLM(ModelConfig.from_hf({**MIXTRAL_8X7B, **SMOKE, "num_hidden_layers": 2,
                                              "architectures": ["LlamaForCausalLM"]}))  # fmt: skip
    total = sum(p.numel() * 4 for p in moe.parameters())  # float32
    expert = 3 * 256 * 128 * 4
    # one token reaches its top-2 of each layer's 8 experts
    assert step_weight_bytes(moe, 1) == pytest.approx(total - 2 * 6 * expert, rel=1e-12)
    assert step_weight_bytes(dense, 1) == sum(p.numel() * 4 for p in dense.parameters())


@pytest.mark.parametrize("path", ["fused", "dense", "grouped"])
def test_mixtral_smoke_run(monkeypatch, tmp_path, path):
    seen = []  # the path every MoE forward took
    resolve = SparseMoE.path
    monkeypatch.setattr(
        SparseMoE, "path", lambda self, x: seen.append(resolve(self, x)) or seen[-1]
    )
    out = tmp_path / "r.json"
    _main(monkeypatch, *SMOKE_ARGS, "--shape", "mixtral", "--moe-path", path, "--out", str(out))
    doc = json.loads(out.read_text())
    assert set(seen) == {path}
    assert (doc["model"], doc["moe_path"], doc["layers"]) == ("Mixtral-8x7B shape, random bf16 weights", path, 2)  # fmt: skip
    rows = {r["distinct_adapters"]: r for r in doc["results"]}
    assert [r["shape"] for r in doc["results"]] == ["mixtral", "mixtral"]
    assert rows[0]["expected_experts_per_layer"] == pytest.approx(8 * (1 - 0.75**4))
    bw = doc["copy_bandwidth_Bps"]
    floor = {n: r["hbm_floor_step_ms"] / 1e3 * bw for n, r in rows.items()}
    h, q, kv, inter, vocab, layers, rank = 128, 128, 64, 256, 512, 2, 16
    attn_layer = (h * (q + 2 * kv) + q * h + 2 * h + 8 * h) * 2  # qkv, o, 2 norms, router; bf16
    experts = rows[0]["expected_experts_per_layer"] * 3 * inter * h * 2
    weights = 2 * vocab * h * 2 + h * 2 + layers * (attn_layer + experts)
    kv_cache = 4 * (8 + 2) * layers * 2 * kv * 2
    assert floor[0] == pytest.approx(weights + kv_cache, rel=1e-9)
    # an adapter: A and B of q, k, v and o only (no MLP side), 32 slots' rank 16
    adapter = layers * rank * (3 * h + q + 2 * kv + q + h) * 2
    assert floor[2] - floor[0] == pytest.approx(2 * adapter, rel=1e-9)


def test_llama_smoke_rows_name_their_shape(monkeypatch, tmp_path, capsys):
    out = tmp_path / "r.json"
    _main(monkeypatch, *SMOKE_ARGS, "--out", str(out))
    doc = json.loads(out.read_text())
    assert [r["shape"] for r in doc["results"]] == ["llama", "llama"]
    assert "moe_path" not in doc and "expected_experts_per_layer" not in doc["results"][0]
    assert "experts top-" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--shape", "mixtral", "--moe-path", "grouped"], "CUDA graph cannot capture"),
        (["--moe-path", "dense"], "the llama shape has no MoE layers"),
    ],
)
def test_refused_flags(monkeypatch, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        _main(monkeypatch, *args)
    assert exc.value.code == 2 and message in capsys.readouterr().err
