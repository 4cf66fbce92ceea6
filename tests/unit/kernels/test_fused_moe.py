"""kernels.fused_moe: the Triton kernels in the CPU interpreter (and the torch reference)
against the float64 oracle on fresh random inputs and small shapes, with the pair buffers
poisoned; the final sum over a token's choices bit for bit; argument refusals. The
alignment is tested in test_moe_align.py.

bf16 is left to tests/gpu (see test_triton_kernels.py: the interpreter's bf16 dots).
"""

import pytest
import torch

from kernels import fused_moe
from kernels.backend import moe_prep
from kernels.testing import MOE_TOLERANCE, oracle_moe, random_moe, random_routing, rel_err
from kernels.triton.fused_moe import moe_config
from kernels.triton.moe_sum import moe_sum

CASES = [  # T, H, I, E_local, k, off_frac, experts left without tokens
    (1, 64, 48, 4, 1, 0.0, ()),  # decode, one choice
    (1, 64, 48, 4, 2, 0.0, ()),
    (1, 64, 48, 4, 2, 1.0, ()),  # every choice another rank's: zeros
    (5, 72, 40, 8, 2, 0.3, (1, 6)),  # H and I not multiples of BLOCK_K; 1-16 rows an expert
    (9, 64, 32, 3, 3, 0.2, (0,)),
    (40, 48, 64, 4, 2, 0.1, (2,)),  # 64-row blocks, under 64 rows an expert
    (70, 32, 48, 2, 2, 0.0, ()),  # 64-row blocks, several per expert
    (150, 32, 32, 2, 2, 0.1, ()),  # 128-row blocks
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tokens", "hidden", "inter", "experts", "top_k", "off", "skip"), CASES)
def test_triton_matches_oracle(
    triton_backend, poisoned, dtype, tokens, hidden, inter, experts, top_k, off, skip
):
    """The pair rows of other ranks' pairs are left NaN (poisoned): the sum never reads them."""
    x, w13, w2, ids, w = random_moe(tokens, hidden, inter, experts, top_k, off, dtype, "cpu", skip)
    out = torch.full((tokens, hidden), float("nan"), dtype=dtype)  # every row is written
    assert fused_moe(x, w13, w2, ids, w, out=out) is out
    want = oracle_moe(x, w13, w2, ids, w)
    assert rel_err(out, want) < MOE_TOLERANCE[dtype]
    off_rank = ((ids < 0) | (ids >= experts)).all(1)
    assert out[off_rank].count_nonzero() == 0 and out.isfinite().all()
    assert torch.equal(fused_moe(x, w13, w2, ids, w), out)  # a new tensor, same values


@pytest.mark.parametrize("prep", ["triton", "torch"])
def test_long_steps_run_in_chunks_equal_to_one_pass(monkeypatch, triton_backend, prep):
    """Past CHUNK_TOKENS a step runs in chunks (the last one shorter), each written into
    its rows of out: the same values as one pass, and strided x / out rows still land."""
    import kernels.triton.fused_moe as fm

    monkeypatch.setenv("LORAFLEET_MOE_PREP", prep)
    x, w13, w2, ids, w = random_moe(23, 48, 40, 5, 2, 0.2, torch.float32, "cpu", (3,))
    whole = fused_moe(x, w13, w2, ids, w)
    calls = []
    one_pass = fm._fused_pass
    monkeypatch.setattr(fm, "_fused_pass", lambda *a: calls.append(a[0].shape[0]) or one_pass(*a))
    monkeypatch.setattr(fm, "CHUNK_TOKENS", 8)
    out = torch.full((23, 96), float("nan"))[:, ::2]  # every other column: strided rows
    x_t = x.t().contiguous().t()
    assert fused_moe(x_t, w13, w2, ids, w, out=out) is out
    assert calls == [8, 8, 7]
    assert rel_err(out, whole) < 1e-6 and out.isfinite().all()


def test_config_tiers_are_all_exercised():
    """CASES reach each of moe_config's four tile choices, every block height."""
    configs = {moe_config(t, k, e) for t, _, _, e, k, _, _ in CASES}
    assert len(configs) == 4 and {c.block_m for c in configs} == {16, 64, 128}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_reference(monkeypatch, dtype):
    x, w13, w2, ids, w = random_moe(30, 48, 40, 6, 4, 0.2, dtype, "cpu", (2,))
    monkeypatch.setenv("LORAFLEET_KERNELS", "reference")
    want = fused_moe(x, w13, w2, ids, w)
    monkeypatch.setenv("LORAFLEET_KERNELS", "triton")
    assert rel_err(fused_moe(x, w13, w2, ids, w), want) < MOE_TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_torch_prep_equals_triton_prep(monkeypatch, triton_backend, dtype):
    """LORAFLEET_MOE_PREP=torch (align_moe_ref, a zero fill, torch.sum; kept to compare
    against) and =triton (the default: the two-launch alignment and moe_sum) run the same
    GEMM tiles, so their layers agree bit for bit where torch.sum adds in choice order
    (k = 2 here)."""
    x, w13, w2, ids, w = random_moe(21, 48, 40, 6, 2, 0.3, dtype, "cpu", (1,))
    monkeypatch.setenv("LORAFLEET_MOE_PREP", "torch")
    want = fused_moe(x, w13, w2, ids, w)
    assert rel_err(want, oracle_moe(x, w13, w2, ids, w)) < MOE_TOLERANCE[dtype]
    monkeypatch.setenv("LORAFLEET_MOE_PREP", "triton")
    assert torch.equal(fused_moe(x, w13, w2, ids, w), want)


def test_moe_prep_default_and_refusal(monkeypatch):
    monkeypatch.delenv("LORAFLEET_MOE_PREP", raising=False)
    assert moe_prep() == "triton"  # on every device: the GPU tests passed on an H100
    monkeypatch.setenv("LORAFLEET_MOE_PREP", "torch")
    assert moe_prep() == "torch"
    monkeypatch.setenv("LORAFLEET_MOE_PREP", "cuda")
    with pytest.raises(ValueError, match="LORAFLEET_MOE_PREP='cuda'; allowed: auto, triton, torch"):
        moe_prep()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("tokens", "top_k", "hidden"), [(1, 1, 40), (5, 2, 600), (11, 3, 64), (9, 8, 24)]
)
def test_sum_adds_local_pairs_in_choice_order(dtype, tokens, top_k, hidden):
    """moe_sum = the fp32 sum over choices 0, 1, ... of the local pairs' rows, rounded
    once, bit for bit, into a strided out; rows of other ranks' pairs are NaN and unread.
    Where torch.sum over a zero-filled y adds in the same order (fp16 on CPU; fp32 up to
    4 choices), it is that sum bit for bit: the zero fill it replaces."""
    ids, _ = random_routing(tokens, top_k, 4, 0.3, "cpu")
    local = (ids >= 0) & (ids < 4)
    y = torch.randn(tokens, top_k, hidden).to(dtype).masked_fill(~local[..., None], float("nan"))
    out = torch.full((hidden, tokens), float("nan"), dtype=dtype).t()  # strides (1, T)
    assert moe_sum(y.view(-1, hidden), ids, 4, out) is out
    acc = torch.zeros(tokens, hidden)
    for j in range(top_k):
        acc += torch.where(local[:, j, None], y[:, j].float(), 0.0)
    assert torch.equal(out, acc.to(dtype))
    if dtype == torch.float16 or top_k <= 4:
        assert torch.equal(out, torch.sum(torch.where(local[..., None], y, 0.0), dim=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_matches_oracle(dtype):
    x, w13, w2, ids, w = random_moe(23, 48, 40, 4, 2, 0.3, dtype, "cpu", (3,))
    out = torch.full((23, 48), float("nan"), dtype=dtype)
    fused_moe(x, w13, w2, ids, w, out=out)
    assert rel_err(out, oracle_moe(x, w13, w2, ids, w)) < MOE_TOLERANCE[dtype]


def test_strided_inputs_and_int32_ids(triton_backend):
    x, w13, w2, ids, w = random_moe(6, 40, 24, 4, 2, 0.2, torch.float32, "cpu")
    x_t = x.t().contiguous().t()  # [6, 40], strides (1, 6)
    w_t = w.t().contiguous().t()
    w13_t = w13.transpose(1, 2).contiguous().transpose(1, 2)  # H-major rows
    out = fused_moe(x_t, w13_t, w2, ids.int(), w_t)
    assert rel_err(out, oracle_moe(x, w13, w2, ids, w)) < MOE_TOLERANCE[torch.float32]


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_no_tokens(monkeypatch, backend):
    monkeypatch.setenv("LORAFLEET_KERNELS", backend)
    x, w13, w2, ids, w = random_moe(0, 32, 16, 2, 2, 0.0, torch.float32, "cpu")
    assert fused_moe(x, w13, w2, ids, w).shape == (0, 32)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_no_local_experts_gives_zeros(monkeypatch, backend):
    """E_local = 0 (w13 [0, 2I, H]): every id is another rank's, so every row is 0, as
    the reference computes it (the Triton launcher divided by E_local for its tiles)."""
    monkeypatch.setenv("LORAFLEET_KERNELS", backend)
    x = torch.randn(20, 32)
    ids = torch.zeros(20, 2, dtype=torch.long)
    out = fused_moe(x, torch.zeros(0, 32, 32), torch.zeros(0, 32, 16), ids, torch.ones(20, 2))
    assert out.shape == (20, 32) and out.count_nonzero() == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"x": torch.zeros(3, 8, dtype=torch.long)}, "x: a 2-D float tensor"),
        ({"w13": torch.zeros(2, 12, 8)}, r"w13 is torch.float32 .*allowed: x's torch.float16"),
        ({"w13": torch.zeros(2, 11, 8, dtype=torch.float16)}, r"w13: \[2, 11, 8\]; allowed"),
        ({"w2": torch.zeros(2, 8, 5, dtype=torch.float16)}, r"w2: \[2, 8, 5\]; allowed: \[2, 8, 6\]"),
        ({"topk_ids": torch.zeros(3, 2)}, r"topk_ids: torch.float32 \(3, 2\); allowed: int32/int64"),
        ({"topk_weights": torch.ones(3, 2, dtype=torch.float16)}, "topk_weights: torch.float16"),
        ({"topk_weights": torch.ones(3, 1)}, r"topk_weights: \[3, 1\]; allowed: topk_ids' \[3, 2\]"),
        ({"out": torch.zeros(3, 8)}, r"out: torch.float32 \(3, 8\); allowed: torch.float16"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_bad_arguments_refused(monkeypatch, backend, change, message):
    monkeypatch.setenv("LORAFLEET_KERNELS", backend)
    args = dict(
        x=torch.zeros(3, 8, dtype=torch.float16),
        w13=torch.zeros(2, 12, 8, dtype=torch.float16),
        w2=torch.zeros(2, 8, 6, dtype=torch.float16),
        topk_ids=torch.zeros(3, 2, dtype=torch.long),
        topk_weights=torch.ones(3, 2),
        out=None,
    )
    args.update(change)
    out = args.pop("out")
    with pytest.raises(ValueError, match=message):
        fused_moe(*args.values(), out=out)


@pytest.mark.parametrize(
    ("var", "value"), [("LORAFLEET_MOE_PREP", "cuda"), ("LORAFLEET_KERNELS", "x")]
)
def test_a_bad_kernel_env_fails_the_model_build(monkeypatch, tmp_path, var, value):
    """A bad value is refused when a shard is built (before the model loads: tmp_path
    holds no model), naming it, not on the first MoE or LoRA forward pass."""
    from replica.config import EngineConfig
    from replica.engine_setup import build_shard

    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=f"{var}='{value}'; allowed: auto"):
        build_shard(EngineConfig(model=str(tmp_path)), torch.device("cpu"))
