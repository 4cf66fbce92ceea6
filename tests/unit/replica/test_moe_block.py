"""The MoE block (replica.models.moe) against transformers' MixtralSparseMoeBlock on fresh
random weights and inputs: every compute path (fused: the Triton kernels, in the
interpreter where there is no GPU), every expert-parallel split (the ranks'
partial outputs summed, as the all-reduce does), and the loader giving each rank exactly
its experts from either checkpoint naming (and failing when one of them is missing);
expert counts a config cannot have are refused."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from lora_core.errors import InvalidRequest, ModelLoadFailed
from replica.models.config import ModelConfig
from replica.models.llama import CausalLM
from replica.models.loader import load_weights, read_config
from replica.models.moe import LocalExperts, Router, SparseMoE
from replica.parallel import TPGroup
from tests.tiny import make_tiny_mixtral

H, INTER = 32, 48


def _hf_block(experts: int, top_k: int, seed: int) -> MixtralSparseMoeBlock:
    cfg = transformers.MixtralConfig(
        hidden_size=H, intermediate_size=INTER, num_local_experts=experts, num_experts_per_tok=top_k
    )
    block = MixtralSparseMoeBlock(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return block


def _ours(block: MixtralSparseMoeBlock, rank: int, size: int) -> tuple[Router, LocalExperts]:
    hf = block.experts
    tp = TPGroup(rank, size, pg=None if size == 1 else object())  # no collective runs
    experts = LocalExperts(hf.num_experts, H, INTER, tp)
    assert experts.weight_loader("gate_up_proj", hf.gate_up_proj.data, None, 0) == (
        experts.pieces("gate_up_proj")
    )
    experts.weight_loader("down_proj", hf.down_proj.data, None, 0)
    router = Router(H, hf.num_experts, block.top_k)
    router.weight.data.copy_(block.gate.weight.data)
    return router, experts


@pytest.mark.parametrize("path", ["grouped", "dense", "fused"])
@pytest.mark.parametrize(
    ("experts", "top_k", "size"), [(4, 2, 1), (4, 2, 2), (8, 2, 4), (8, 1, 2), (8, 3, 8)]
)
def test_expert_parallel_block_equals_transformers(monkeypatch, path, experts, top_k, size):
    if path == "fused" and os.environ.get("TRITON_INTERPRET") == "1":
        monkeypatch.setenv("LORAFLEET_KERNELS", "triton")
    block = _hf_block(experts, top_k, seed=experts * 10 + top_k)
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(size))
    with torch.no_grad():
        want = block(x[None])[0]
        got = torch.zeros_like(x)
        for rank in range(size):
            router, local = _ours(block, rank, size)
            weights, ids = router(x)
            got += getattr(local, path)(x, ids - local.first, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_every_path_gives_zeros_when_no_token_picks_a_local_expert(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") == "1":
        monkeypatch.setenv("LORAFLEET_KERNELS", "triton")
    block = _hf_block(4, 1, seed=3)
    router, local = _ours(block, 1, 2)  # experts 2, 3
    x = torch.randn(5, H)
    ids = torch.zeros(5, 1, dtype=torch.long)  # every token routed to expert 0 (rank 0's)
    w = torch.ones(5, 1)
    for path in ("grouped", "dense", "fused"):
        assert getattr(local, path)(x, ids - local.first, w).count_nonzero() == 0


def test_unknown_compute_path_is_refused(tmp_path):
    cfg = read_config(make_tiny_mixtral(tmp_path / "m", seed=1))
    moe = SparseMoE(cfg)
    moe.compute = "sparse"
    with pytest.raises(ValueError, match="compute='sparse'; allowed: auto, fused, grouped, dense"):
        moe(torch.zeros(1, cfg.hidden_size))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_auto_is_grouped_on_the_cpu(monkeypatch, tmp_path, backend):
    """Forced paths are taken as named; auto on CPU tensors is grouped on either backend
    (the fused kernels run there only in the interpreter)."""
    monkeypatch.setenv("LORAFLEET_KERNELS", backend)
    moe = SparseMoE(read_config(make_tiny_mixtral(tmp_path / "m", seed=1)))
    x = torch.zeros(1, moe.gate.weight.shape[1])
    assert moe.path(x) == "grouped"
    for path in ("fused", "grouped", "dense"):
        moe.compute = path
        assert moe.path(x) == path


def test_experts_not_divisible_by_the_group_refused(tmp_path):
    with pytest.raises(
        InvalidRequest, match="num_local_experts=6 is not divisible by tensor_parallel_size=4"
    ):
        LocalExperts(6, H, INTER, TPGroup(0, 4, pg=object()))


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_each_rank_loads_only_its_experts(tmp_path, fused):
    model_dir = make_tiny_mixtral(tmp_path / "m", seed=2, fused=fused)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    cfg = read_config(model_dir)
    for rank in range(2):
        net = CausalLM(cfg, TPGroup(rank, 2, pg=object()))
        load_weights(net, model_dir)  # every parameter covered, else ModelLoadFailed
        for ours, theirs in zip(net.model.layers, hf.model.layers, strict=True):
            want = theirs.mlp.experts
            got = ours.mlp.experts
            assert got.gate_up_proj.shape[0] == 2
            assert got.gate_up_proj.equal(want.gate_up_proj[2 * rank : 2 * rank + 2])
            assert got.down_proj.equal(want.down_proj[2 * rank : 2 * rank + 2])
            assert ours.mlp.gate.weight.equal(theirs.mlp.gate.weight)  # replicated


def test_a_missing_expert_fails_only_the_rank_that_holds_it(tmp_path):
    """...and an expert index past num_local_experts fails every rank (no rank would
    read it: it must not be dropped silently)."""
    model_dir = make_tiny_mixtral(tmp_path / "m", seed=2)
    weights = model_dir / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.layers.1.block_sparse_moe.experts.1.w2.weight"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    cfg = read_config(model_dir)
    with pytest.raises(
        ModelLoadFailed, match=r"lacks 1 tensors, e.g. model.layers.1.mlp.experts.down_proj"
    ):
        load_weights(CausalLM(cfg, TPGroup(0, 2, pg=object())), model_dir)
    load_weights(CausalLM(cfg, TPGroup(1, 2, pg=object())), model_dir)  # experts 2, 3: whole
    tensors["model.layers.1.block_sparse_moe.experts.1.w2.weight"] = tensors.pop(
        "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    )
    tensors["model.layers.1.block_sparse_moe.experts.4.w2.weight"] = torch.zeros(64, 128)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ModelLoadFailed, match=r"expert 4; allowed: 0..3"):  # not dropped
        load_weights(CausalLM(cfg, TPGroup(0, 2, pg=object())), model_dir)


@pytest.mark.parametrize(
    ("changes", "refused"),
    [
        ({"num_experts_per_tok": 5}, "num_experts_per_tok=5; allowed: 1..num_local_experts=4"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok=0; allowed: 1..num_local_experts=4"),
        ({"num_local_experts": 0}, "num_local_experts=0; allowed: >= 1 for MixtralForCausalLM"),
    ],
)
def test_bad_expert_configs_refused(mixtral_dir, changes, refused):
    raw = json.loads((mixtral_dir / "config.json").read_text())
    with pytest.raises(ModelLoadFailed, match=re.escape(refused)):
        ModelConfig.from_hf({**raw, **changes})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dense_ignores_an_unselected_expert_that_overflows(dtype):
    """The dense path runs every local expert on every token; one that overflows to inf
    (or nan) on a token that did not pick it must not reach that token (inf * weight 0 is
    nan): its output stays grouped's, as transformers computes only the picked experts."""
    block = _hf_block(4, 2, seed=4)
    _, local = _ours(block, 0, 1)
    local.to(dtype)
    local.down_proj.data[3] = torch.finfo(dtype).max  # expert 3's output: +-inf
    x = torch.randn(6, H).to(dtype)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0]] * 2)  # no token picks expert 3
    w = torch.full((6, 2), 0.5)
    grouped = local.grouped(x, ids, w)
    assert grouped.isfinite().all()
    torch.testing.assert_close(local.dense(x, ids, w), grouped)
