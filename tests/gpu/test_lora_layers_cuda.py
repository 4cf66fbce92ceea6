"""LinearWithLoRA on CUDA: in a captured decode step each layer's LoRA shrink runs on a side
stream beside the base GEMM (LoraBatchContext.overlap_stream); the replayed graph gives
what the one-stream layer gives, for every group, with the step's workspace or without."""

from __future__ import annotations

import pytest
import torch

from kernels.testing import captured
from lora_core.base_shape import BaseShape
from lora_core.context import LoraBatchContext, workspace_per_token
from lora_core.layers import LORA_TARGETS, LinearWithLoRA
from lora_core.slot_buffers import SlotBuffers
from replica.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
BASE = BaseShape("LlamaForCausalLM", 1, 1024, 8, 2, 128, 3584)
SLOTS = 8


def _base_layers() -> dict[str, torch.nn.Module]:
    b = BASE
    layers = {
        "qkv": QKVParallelLinear(b.hidden, b.head_dim, b.num_heads, b.num_kv_heads, False),
        "o": RowParallelLinear(b.num_heads * b.head_dim, b.hidden),
        "gate_up": MergedColumnParallelLinear(b.hidden, (b.intermediate,) * 2),
        "down": RowParallelLinear(b.intermediate, b.hidden),
    }
    for m in layers.values():
        m.to(CUDA, torch.bfloat16)
        for p in m.parameters():
            p.data.normal_(0, 0.02)
    return layers


def _wrapped(workspace: bool, overlap: int):
    buffers = SlotBuffers(BASE, SLOTS, 16, torch.bfloat16, CUDA)
    for _, group in LORA_TARGETS:
        for t in buffers.a(0, group) + buffers.b(0, group):
            t.normal_(0, 0.05)
    buffers.slot_ranks.copy_(torch.tensor([16, 8, 16, 4, 16, 16, 12, 16], dtype=torch.int32))
    ctx = LoraBatchContext(
        64,
        CUDA,
        buffers.slot_ranks,
        workspace_per_token(BASE, 16) if workspace else 0,
        max_rank=16,
        overlap_max_tokens=overlap,
    )
    base = _base_layers()
    return ctx, {g: LinearWithLoRA(base[g], 0, g, buffers, ctx) for g in base}


@pytest.mark.parametrize("workspace", [True, False], ids=["step-workspace", "own-buffer"])
@pytest.mark.parametrize("tokens", [1, 37])
def test_captured_overlap_equals_one_stream(workspace: bool, tokens: int) -> None:
    torch.manual_seed(tokens)
    ctx, layers = _wrapped(workspace, overlap=256)
    slots = torch.randint(-1, SLOTS, (tokens,), dtype=torch.int32)
    slots[0] = 1
    slots = slots.to(CUDA)  # set() inside the capture copies it device to device
    xs = {
        g: torch.randn(tokens, lay.in_features, device=CUDA, dtype=torch.bfloat16)
        for g, lay in layers.items()
    }
    ys = {g: torch.full((tokens, sum(lay.output_sizes)), float("nan"), device=CUDA,
                        dtype=torch.bfloat16) for g, lay in layers.items()}  # fmt: skip
    sides = []

    def step():
        ctx.set(slots, True, expected_slots=SLOTS)
        for g, lay in layers.items():
            sides.append(ctx.overlap_stream(xs[g]))
            ys[g].copy_(lay(xs[g]))

    graph = captured(step)
    assert sides[: len(layers)] == [None] * len(layers)  # eager: one stream
    assert all(s is not None for s in sides[len(layers) :])  # captured: beside the GEMM
    for y in ys.values():
        y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ctx.overlap_max_tokens = 0  # the same layers, one stream, eagerly
    ctx.set(slots, True, expected_slots=SLOTS)
    for g, lay in layers.items():
        want = lay(xs[g]).float()
        got = ys[g].float()
        assert not got.isnan().any(), g
        # split-K shrinks sum with fp32 atomics in any order: bf16 rounding of y may differ
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=g)


def test_overlap_only_where_capturing_on_cuda() -> None:
    ctx = LoraBatchContext(64, CUDA, overlap_max_tokens=16)
    x = torch.zeros(8, 4, device=CUDA)
    assert ctx.overlap_stream(x) is None  # not capturing
    assert ctx.overlap_stream(x.cpu()) is None
