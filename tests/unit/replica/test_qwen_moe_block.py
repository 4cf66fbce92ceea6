"""The MoE block (replica.models.moe) against transformers' Qwen3MoeSparseMoeBlock and
Qwen2MoeSparseMoeBlock (its gated shared expert) on fresh random weights and inputs:
both compute paths, norm_topk_prob on and off, every expert-parallel split (the ranks'
partial outputs summed, as the all-reduce does: the shared expert split by its
intermediate features, each rank scaling its partial by the whole gate), and bfloat16
bit for bit (the routing weights rounded to the model's dtype, as transformers does);
the loader giving each rank exactly its experts and its shared-expert shard from either
checkpoint naming; Qwen MoE configs read as transformers reads them, and refused where
no model can be built."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from lora_core.base_shape import BaseShape
from lora_core.errors import InvalidRequest, ModelLoadFailed
from replica.models.config import ModelConfig
from replica.models.llama import CausalLM
from replica.models.loader import load_weights, read_config
from replica.models.moe import SparseMoE
from replica.parallel import TPGroup
from tests.tiny import make_tiny_qwen_moe

H, INTER, SHARED = 32, 24, 40
BLOCKS = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, Qwen3MoeSparseMoeBlock, "Qwen3MoeForCausalLM"),
    "qwen2_moe": (transformers.Qwen2MoeConfig, Qwen2MoeSparseMoeBlock, "Qwen2MoeForCausalLM"),
}


def _hf_block(arch: str, experts: int, top_k: int, norm: bool, seed: int):
    """(transformers' block of random weights, our ModelConfig of the same config)."""
    cfg_cls, block_cls, name = BLOCKS[arch]
    cfg = cfg_cls(
        hidden_size=H, num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=INTER,
        shared_expert_intermediate_size=SHARED, num_experts=experts, num_experts_per_tok=top_k,
        norm_topk_prob=norm, num_hidden_layers=1,
    )  # fmt: skip
    block = block_cls(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return block, ModelConfig.from_hf({**cfg.to_dict(), "architectures": [name]})


def _ours(block, cfg: ModelConfig, rank: int, size: int) -> SparseMoE:
    tp = TPGroup(rank, size, pg=None if size == 1 else object())  # no collective runs
    moe = SparseMoE(cfg, tp)
    moe.experts.weight_loader("gate_up_proj", block.experts.gate_up_proj.data, None, 0)
    moe.experts.weight_loader("down_proj", block.experts.down_proj.data, None, 0)
    moe.gate.weight.data.copy_(block.gate.weight.data)
    if cfg.shared_expert_intermediate_size:
        shared, theirs = moe.shared_expert, block.shared_expert
        shared.gate_up_proj.weight_loader(shared.gate_up_proj.weight, theirs.gate_proj.weight, 0)
        shared.gate_up_proj.weight_loader(shared.gate_up_proj.weight, theirs.up_proj.weight, 1)
        shared.down_proj.weight_loader(shared.down_proj.weight, theirs.down_proj.weight)
        moe.shared_expert_gate.weight.data.copy_(block.shared_expert_gate.weight.data)
    return moe


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("path", ["grouped", "dense"])
@pytest.mark.parametrize("norm", [False, True], ids=["raw", "norm"])
@pytest.mark.parametrize(("experts", "top_k", "size"), [(4, 2, 1), (4, 2, 2), (8, 3, 4)])
def test_expert_parallel_block_equals_transformers(arch, path, norm, experts, top_k, size):
    block, cfg = _hf_block(arch, experts, top_k, norm, seed=experts * 10 + top_k)
    assert cfg.norm_topk_prob == norm
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(size))
    with torch.no_grad():
        want = block(x[None])[0]
        got = torch.zeros_like(x)
        for rank in range(size):
            moe = _ours(block, cfg, rank, size)
            moe.compute = path
            got += moe.partial(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("path", ["grouped", "dense"])
def test_bfloat16_equals_transformers_bit_for_bit(arch, path):
    block, cfg = _hf_block(arch, 4, 2, norm=False, seed=7)
    block.to(torch.bfloat16)
    moe = _ours(block, cfg, 0, 1).to(torch.bfloat16)
    moe.compute = path
    x = torch.randn(29, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        assert moe(x).equal(block(x[None])[0])


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_each_rank_loads_only_its_experts_and_shard(tmp_path, arch, fused):
    model_dir = make_tiny_qwen_moe(
        tmp_path / "m", arch, seed=2, fused=fused, num_hidden_layers=3, mlp_only_layers=[1]
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    cfg = read_config(model_dir)
    for rank in range(2):
        net = CausalLM(cfg, TPGroup(rank, 2, pg=object()))
        load_weights(net, model_dir)  # every parameter covered, else ModelLoadFailed
        for i in (0, 2):
            ours, theirs = net.model.layers[i].mlp, hf.model.layers[i].mlp
            assert ours.experts.gate_up_proj.equal(
                theirs.experts.gate_up_proj[2 * rank : 2 * rank + 2]
            )
            assert ours.experts.down_proj.equal(theirs.experts.down_proj[2 * rank : 2 * rank + 2])
            assert ours.gate.weight.equal(theirs.gate.weight)  # replicated
            if arch == "qwen2_moe":
                rows = slice(48 * rank, 48 * rank + 48)  # 96 shared features, half each
                gate, up = ours.shared_expert.gate_up_proj.weight.split(48)
                assert gate.equal(theirs.shared_expert.gate_proj.weight[rows])
                assert up.equal(theirs.shared_expert.up_proj.weight[rows])
                down = theirs.shared_expert.down_proj.weight[:, rows]
                assert ours.shared_expert.down_proj.weight.equal(down)
                assert ours.shared_expert_gate.weight.equal(theirs.shared_expert_gate.weight)
        dense, theirs = net.model.layers[1].mlp, hf.model.layers[1].mlp
        assert dense.down_proj.weight.equal(theirs.down_proj.weight[:, 64 * rank : 64 * rank + 64])


def _raw(arch: str, **fields) -> dict:
    """A 4-layer config.json of `arch` as transformers writes it, with `fields` changed."""
    cfg_cls, _, name = BLOCKS[arch]
    cfg = cfg_cls(
        vocab_size=64, hidden_size=H, num_attention_heads=4, num_key_value_heads=4,
        num_hidden_layers=4, intermediate_size=16, moe_intermediate_size=8, num_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip
    return {**cfg.to_dict(), "architectures": [name], **fields}


@pytest.mark.parametrize(
    ("fields", "sparse"),
    [
        ({}, (True,) * 4),
        ({"mlp_only_layers": [0, 3]}, (False, True, True, False)),
        ({"decoder_sparse_step": 2}, (False, True, False, True)),
        ({"decoder_sparse_step": 2, "mlp_only_layers": [1]}, (False, False, False, True)),
    ],
)
def test_sparse_layers_as_transformers_builds_them(fields, sparse):
    for arch in BLOCKS:
        cfg = ModelConfig.from_hf(_raw(arch, **fields))
        assert cfg.moe_layers == sparse
        assert cfg.base_shape == BaseShape.from_hf_config(_raw(arch, **fields))
        hf = transformers.AutoModelForCausalLM.from_config(
            BLOCKS[arch][0](
                **{k: v for k, v in _raw(arch, **fields).items() if k != "architectures"}
            )
        )
        assert (
            tuple(type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers)
            == sparse
        )


def test_configs_read_as_transformers_reads_them():
    """Qwen3-MoE's expert count is read under either name (transformers 5 writes
    num_local_experts, the hub's checkpoints num_experts); Qwen2-MoE has q/k/v biases
    unless qkv_bias is false, Qwen3-MoE q/k norms and, with attention_bias, o's bias."""
    written = _raw("qwen3_moe")
    assert (written["num_local_experts"], "num_experts" in written) == (4, False)
    assert ModelConfig.from_hf(written).num_experts == 4
    hub = {k: v for k, v in written.items() if k != "num_local_experts"}
    assert ModelConfig.from_hf({**hub, "num_experts": 8}).num_experts == 8
    cfg = ModelConfig.from_hf(_raw("qwen3_moe", attention_bias=True))
    assert (cfg.qkv_bias, cfg.o_bias, cfg.qk_norm, cfg.moe_weights_cast) == (True, True, True, True)
    cfg = ModelConfig.from_hf(_raw("qwen2_moe"))
    assert (cfg.qkv_bias, cfg.o_bias, cfg.qk_norm, cfg.norm_topk_prob) == (
        True,
        False,
        False,
        False,
    )
    assert (cfg.shared_expert_intermediate_size, cfg.moe_intermediate_size) == (5632, 8)
    assert not ModelConfig.from_hf(_raw("qwen2_moe", qkv_bias=False)).qkv_bias


@pytest.mark.parametrize(
    ("arch", "fields", "refused"),
    [
        ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step=0; allowed: an integer >= 1"),
        ("qwen3_moe", {"mlp_only_layers": [4]}, "mlp_only_layers=[4]; allowed: a list of layer indices 0..3"),
        ("qwen3_moe", {"num_experts": 0}, "num_experts=0; allowed: >= 1 for Qwen3MoeForCausalLM"),
        ("qwen2_moe", {"num_experts_per_tok": 5}, "num_experts_per_tok=5; allowed: 1..num_experts=4"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0; allowed: an integer >= 1"),
        ("qwen2_moe", {"moe_intermediate_size": 0}, "moe_intermediate_size=0; allowed: an integer >= 1"),
    ],
)  # fmt: skip
def test_bad_qwen_moe_configs_refused(arch, fields, refused):
    with pytest.raises(ModelLoadFailed, match=re.escape(refused)):
        ModelConfig.from_hf(_raw(arch, **fields))


@pytest.mark.parametrize(
    ("arch", "fields", "size", "refused"),
    [
        ("qwen3_moe", {"num_experts": 6}, 4, "num_experts=6 is not divisible by tensor_parallel_size=4"),
        # a dense layer's intermediate is split, the experts' is not
        ("qwen3_moe", {"num_experts": 8, "intermediate_size": 30, "moe_intermediate_size": 31,
                       "mlp_only_layers": [1]}, 4, "intermediate_size=30 is not divisible"),
        ("qwen2_moe", {"num_experts": 8, "shared_expert_intermediate_size": 30}, 4,
         "shared_expert_intermediate_size=30 is not divisible by tensor_parallel_size=4"),
    ],
)  # fmt: skip
def test_splits_the_model_cannot_take_refused(arch, fields, size, refused):
    cfg = ModelConfig.from_hf(_raw(arch, **fields))
    with pytest.raises(InvalidRequest, match=re.escape(refused)):
        cfg.check_tensor_parallel(size)
    ModelConfig.from_hf(_raw(arch, **{**fields, "mlp_only_layers": []})).check_tensor_parallel(2)


def test_a_missing_shared_expert_tensor_fails_the_load(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = make_tiny_qwen_moe(tmp_path / "m", "qwen2_moe", seed=3)
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors["model.layers.1.mlp.shared_expert_gate.weight"]
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ModelLoadFailed, match=r"lacks 1 tensors, e.g. model.layers.1.mlp.shared_expert_gate"
    ):
        load_weights(CausalLM(read_config(model_dir)), model_dir)
    assert json.loads((model_dir / "config.json").read_text())["num_experts"] == 4
