from pathlib import Path

import pytest
import torch
from torch import nn

import kernels
from lora_core.base_shape import GROUPS
from lora_core.context import LoraBatchContext
from lora_core.errors import AdapterIncompatible
from lora_core.layers import LORA_TARGETS, LinearWithLoRA, apply_lora
from lora_core.slot_buffers import SlotBuffers
from lora_core.validate import validate_adapter_dir
from lora_core.weights import load_adapter_weights
from replica.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class _Attn(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            base.hidden, base.head_dim, base.num_heads, base.num_kv_heads, False
        )
        self.o_proj = RowParallelLinear(base.num_heads * base.head_dim, base.hidden)


class _Mlp(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(base.hidden, (base.intermediate,) * 2)
        self.down_proj = RowParallelLinear(base.intermediate, base.hidden)


class _Layer(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.self_attn = _Attn(base)
        self.mlp = _Mlp(base)


class EngineLikeModel(nn.Module):
    """The shape of the engine's model that apply_lora relies on: model.layers[i]...."""

    def __init__(self, base, hf_layers=None):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(base) for _ in range(base.num_layers))
        for mine, hf in zip(self.layers, hf_layers or [], strict=hf_layers is not None):
            fused = {
                "self_attn.qkv_proj": [
                    hf.self_attn.q_proj,
                    hf.self_attn.k_proj,
                    hf.self_attn.v_proj,
                ],
                "self_attn.o_proj": [hf.self_attn.o_proj],
                "mlp.gate_up_proj": [hf.mlp.gate_proj, hf.mlp.up_proj],
                "mlp.down_proj": [hf.mlp.down_proj],
            }
            for path, parts in fused.items():
                lin = mine.get_submodule(path)
                for shard, part in enumerate(parts):
                    w = getattr(part, "base_layer", part).weight.detach()
                    lin.weight_loader(lin.weight, w, shard if len(parts) > 1 else None)


def _hf_module(peft_model, layer: int, name: str):
    decoder = peft_model.base_model.model.model.layers[layer]
    return getattr(decoder.self_attn if name in ALL[:4] else decoder.mlp, name)


ADAPTERS = {
    "a": dict(target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], r=4),
    "b": dict(
        target_modules=ALL,
        r=8,
        rank_pattern={"k_proj": 2},
        alpha_pattern={"up_proj": 3},
        lora_seed=7,
    ),
}


@pytest.fixture(params=[False, True], ids=["two-kernels", "stacked"])
def setup(tmp_path: Path, build_peft, base, request):
    peft_models, weights = {}, {}
    for name, kw in ADAPTERS.items():
        peft_models[name] = build_peft(**kw)
        peft_models[name].save_pretrained(str(tmp_path / name))
        manifest = validate_adapter_dir(tmp_path / name, max_rank=8, base=base)
        weights[name] = load_adapter_weights(manifest, base, torch.float32)
    model = EngineLikeModel(base, peft_models["a"].base_model.model.model.layers)
    buffers = SlotBuffers(base, max_loras=3, max_rank=8, dtype=torch.float32, device="cpu")
    ctx = LoraBatchContext(max_num_tokens=16, device="cpu")
    apply_lora(model, buffers, ctx, stacked=request.param)
    return model, buffers, ctx, peft_models, weights


def _expected(peft_models, slot_to_adapter, layer, group, x, slots):
    """Per token: the PEFT modules of that token's adapter (or the base layers), concatenated."""
    rows = []
    for t, slot in enumerate(slots):
        # "b" targets every module, so its base_layer's are the plain base projections
        pm = peft_models[slot_to_adapter[slot]] if slot >= 0 else peft_models["b"]
        mods = [_hf_module(pm, layer, m) for m in GROUPS[group]]
        if slot < 0:
            mods = [m.base_layer for m in mods]
        rows.append(torch.cat([m(x[t : t + 1]) for m in mods], dim=-1))
    return torch.cat(rows)


def test_mixed_batch_equals_peft(setup, base) -> None:
    model, buffers, ctx, peft_models, weights = setup
    buffers.write(2, weights["a"])
    buffers.write(0, weights["b"])
    assert buffers.slot_ranks.tolist() == [8, 0, 4]
    slots = [2, 2, 0, -1, 0, 2, -1]
    ctx.set_slots(slots)
    assert ctx.any_lora and ctx.token_slots.dtype == torch.int32
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in range(base.num_layers):
            for path, group in LORA_TARGETS:
                wrapper = model.layers[layer].get_submodule(path)
                assert isinstance(wrapper, LinearWithLoRA)
                x = torch.randn(len(slots), wrapper.in_features, generator=gen)
                want = _expected(peft_models, {2: "a", 0: "b"}, layer, group, x, slots)
                torch.testing.assert_close(wrapper(x), want, rtol=1e-5, atol=1e-5)


def test_no_lora_tokens_skip_kernels(setup, monkeypatch) -> None:
    model, buffers, ctx, _, weights = setup
    buffers.write(1, weights["b"])
    ctx.set_slots([-1, -1, -1])
    assert not ctx.any_lora

    def boom(*args, **kwargs):
        raise AssertionError("kernel called")

    monkeypatch.setattr(kernels, "lora_shrink", boom)
    wrapper = model.layers[0].self_attn.qkv_proj
    x = torch.randn(3, wrapper.in_features)
    assert torch.equal(wrapper(x), wrapper.base_layer(x))


def test_clear_and_reset_slot(setup) -> None:
    model, buffers, ctx, _, weights = setup
    buffers.write(1, weights["b"])
    wrapper = model.layers[1].mlp.gate_up_proj
    x = torch.randn(2, wrapper.in_features)
    ctx.set_slots([1, 1])
    assert not torch.allclose(wrapper(x), wrapper.base_layer(x))
    wrapper.reset_slot(1)
    assert torch.equal(wrapper(x), wrapper.base_layer(x))
    wrapper.set_slot(1, weights["b"].slices(1, "gate_up"))
    assert not torch.allclose(wrapper(x), wrapper.base_layer(x))
    buffers.clear(1)
    assert buffers.slot_ranks.tolist() == [0, 0, 0]
    for layer in range(2):
        for _, group in LORA_TARGETS:
            assert all(not t[1].any() for t in buffers.a(layer, group) + buffers.b(layer, group))


def test_rewriting_a_slot_zeroes_the_old_adapter(setup) -> None:
    model, buffers, ctx, _, weights = setup
    buffers.write(0, weights["b"])
    buffers.write(0, weights["a"])
    assert buffers.slot_ranks.tolist() == [4, 0, 0]
    a_buf = buffers.a(0, "qkv")
    assert not a_buf[1][0].any()  # k_proj is untargeted by "a"
    assert not a_buf[0][0, 4:].any()  # rank 4 of 8: padding rows zero
    assert not buffers.b(0, "gate_up")[0][0].any()


def test_buffer_layout_matches_kernel_contract(base) -> None:
    buffers = SlotBuffers(base, max_loras=3, max_rank=8, dtype=torch.float16, device="cpu")
    assert [tuple(t.shape) for t in buffers.a(0, "qkv")] == [(3, 8, 64)] * 3
    assert [tuple(t.shape) for t in buffers.b(0, "qkv")] == [(3, 64, 8), (3, 32, 8), (3, 32, 8)]
    assert [tuple(t.shape) for t in buffers.a(1, "down")] == [(3, 8, 128)]
    assert [tuple(t.shape) for t in buffers.b(1, "gate_up")] == [(3, 128, 8)] * 2
    # B rank-major: a rank-r slot's B is r contiguous rows of N (what the expand reads)
    assert [t.stride() for t in buffers.b(0, "qkv")] == [(512, 1, 64), (256, 1, 32), (256, 1, 32)]
    per_layer = 8 * (3 * 64 + 64 + 2 * 32) + 8 * (64 + 64) + 8 * (2 * 64 + 2 * 128) + 8 * (128 + 64)
    assert buffers.nbytes == 2 * 3 * per_layer * 2


def test_write_refuses_too_high_rank(setup, base) -> None:
    _, _, _, _, weights = setup
    narrow = SlotBuffers(base, max_loras=1, max_rank=4, dtype=torch.float32, device="cpu")
    with pytest.raises(AdapterIncompatible, match="rank: adapter rank 8"):
        narrow.write(0, weights["b"])
    with pytest.raises(ValueError, match="slot=1"):
        narrow.write(1, weights["a"])


def test_apply_lora_checks(setup, base) -> None:
    model, buffers, ctx, _, _ = setup
    with pytest.raises(ValueError, match="already wrapped"):
        apply_lora(model, buffers, ctx)
    other = SlotBuffers(base, max_loras=1, max_rank=4, dtype=torch.float32, device="cpu")
    small = EngineLikeModel(base)
    with pytest.raises(ValueError, match="model has 1 layers; the slot buffers 2"):
        apply_lora(_with_layers(small.layers[:1]), other, ctx)
    small.layers[0].mlp.down_proj = RowParallelLinear(64, 64)
    with pytest.raises(ValueError, match=r"layers\[0\]\.down"):
        apply_lora(small, other, ctx)


def _with_layers(layers) -> nn.Module:
    m = nn.Module()
    m.layers = nn.ModuleList(layers)
    return m


def test_context_limits() -> None:
    ctx = LoraBatchContext(max_num_tokens=4, device="cpu")
    ctx.set(torch.tensor([0, -1, 3], dtype=torch.int64), any_lora=True)
    assert ctx.token_slots.tolist() == [0, -1, 3] and ctx.token_slots.dtype == torch.int32
    with pytest.raises(ValueError, match="5 tokens"):
        ctx.set_slots([0] * 5)


def test_context_meta_tile_height_follows_the_pool_rank() -> None:
    """The step's SegmentMeta is built for the slot width (kernels.meta.default_block_m)."""
    ranks = torch.tensor([16, 8], dtype=torch.int32)
    slots = torch.zeros(2048, dtype=torch.int32)
    for max_rank, want in ((16, 32), (64, 64), (None, 64)):
        ctx = LoraBatchContext(
            max_num_tokens=2048, device="cpu", slot_ranks=ranks, max_rank=max_rank
        )
        ctx.set(slots, any_lora=True)
        assert ctx.meta.block_m == want


def test_context_meta_tile_height_follows_the_steps_adapters() -> None:
    """A 257-1024-token step of a rank-64 pool takes 64-row tiles when set() expects at
    least 64 tokens per slot (kernels.meta.default_block_m), else 32."""
    ranks = torch.full((32,), 64, dtype=torch.int32)
    ctx = LoraBatchContext(max_num_tokens=1024, device="cpu", slot_ranks=ranks, max_rank=64)
    for count, want in ((1, 64), (16, 64), (17, 32), (None, 32)):
        slots = torch.arange(1024, dtype=torch.int32) % (count or 32)
        ctx.set(slots, any_lora=True, expected_slots=count)
        assert ctx.meta.block_m == want


def test_context_meta_expects_the_steps_adapters_capped_at_the_pool() -> None:
    """set(..., expected_slots): the step's SegmentMeta sizes the kernels' tile grids for
    that many slots (at most L); without it, for all L."""
    ranks = torch.tensor([16, 8, 16, 4], dtype=torch.int32)
    ctx = LoraBatchContext(max_num_tokens=64, device="cpu", slot_ranks=ranks, max_rank=16)
    slots = torch.tensor([0, 2, -1, 2], dtype=torch.int32)
    for expected, want in ((2, 2), (9, 4), (None, None)):
        ctx.set(slots, any_lora=True, expected_slots=expected)
        assert ctx.meta.expected_slots == want


def test_context_workspace_hands_out_zeroed_disjoint_slices_per_step() -> None:
    from lora_core.context import LoraBatchContext

    ctx = LoraBatchContext(
        max_num_tokens=64, device="cpu", workspace_per_token=2 * 4 + 1 * 4, workspace_tokens=8
    )
    ctx.set(torch.tensor([0, -1, 1], dtype=torch.int32), any_lora=True)
    a, b = ctx.take(2, 3, 4), ctx.take(1, 3, 4)
    assert a.shape == (2, 3, 4) and b.shape == (1, 3, 4)
    assert a.data_ptr() + a.numel() * 4 == b.data_ptr()  # disjoint, back to back
    a.fill_(7.0)
    b.fill_(7.0)
    assert ctx.take(1, 3, 4) is None  # used up: the kernel allocates its own
    ctx.set(torch.tensor([0, -1, 1], dtype=torch.int32), any_lora=True)
    assert float(ctx.take(2, 3, 4).abs().sum()) == 0.0  # zeroed again each step
    ctx.set(torch.zeros(9, dtype=torch.int32), any_lora=True)  # more tokens than the workspace
    assert ctx.take(1, 9, 4) is None
