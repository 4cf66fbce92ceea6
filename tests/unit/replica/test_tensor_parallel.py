"""Tensor parallelism at the model-forward level: two gloo ranks (processes) running the
tiny Llama sharded 2 ways, with LoRA in mixed slots, give the logits and greedy tokens
of the unsharded model (also with an odd, padded vocabulary and tied embeddings: the
logit shards gathered to rank 0; and for the tiny Mixtral, Qwen3-MoE and Qwen2-MoE,
each rank holding half the experts whole); sharded slot buffers hold half the adapter bytes; head counts that do
not divide are refused."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from lora_core.errors import InvalidRequest
from lora_core.slot_buffers import SlotBuffers
from lora_core.validate import validate_adapter_dir
from lora_core.weights import load_adapter_weights
from replica.config import EngineConfig
from replica.engine_setup import build_shard
from replica.layers.linear import QKVParallelLinear
from replica.parallel import SINGLE, TPGroup, free_port
from replica.sampling_params import SamplingParams
from replica.sequence import Sequence

ADAPTERS = ("all16rs", "pattern", "mlp4")  # every group, rank patterns, MLP only
# The adapters in slots 0-2, per adapter fixture: a Mixtral's experts take no LoRA, so
# its adapters are attention ones (all, some, and a regex with a rank pattern).
SLOT_ADAPTERS = {
    "llama": ADAPTERS,
    "qwen2": ADAPTERS,
    "qwen3": ADAPTERS,
    "mixtral": ("qv8", "attn16rs", "pattern"),
    "qwen3_moe": ("qv8", "attn16rs", "pattern"),
    "qwen2_moe": ("qv8", "attn16rs", "pattern"),
}
# (prompt length, slot, first step): slot -1 is the base model; the last sequence joins
# at step 2, so that step mixes its prefill with the others' decode tokens.
SEQS = ((5, 0, 0), (7, 1, 0), (3, -1, 0), (6, 2, 0), (4, 0, 2))  # (length, slot, step)
STEPS = 6


def _scenario(model_dir: str, adapters: list[str], tp: TPGroup) -> dict[str, torch.Tensor]:
    """Prefill + greedy decode of SEQS on rank tp.rank -> {"hidden{step}": [n, H]} and,
    on rank 0, {"logits{step}": [n, V]} (every rank computes its vocab shard of them)."""
    config = EngineConfig(
        model=model_dir,
        device="cpu",
        max_loras=3,
        max_lora_rank=16,
        block_size=4,
        num_kv_blocks=64,
        tensor_parallel_size=tp.size,
    )
    shard = build_shard(config, torch.device("cpu"), tp)
    base = shard.runner.model.config.base_shape
    for slot, path in enumerate(adapters):
        manifest = validate_adapter_dir(path, max_rank=16, base=base)
        shard.buffers.write(slot, load_adapter_weights(manifest, base, torch.float32))
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i, (n, slot, _) in enumerate(SEQS):
        prompt = torch.randint(0, 200, (n,), generator=g).tolist()
        seq = Sequence(f"s{i}", n, prompt, SamplingParams(), None, i, lora_slot=slot)
        seq.block_table = list(range(i * 8, i * 8 + 8))
        seqs.append(seq)
    out = {}
    for step in range(STEPS):
        scheduled = [
            (s, s.remaining) for s, (_, _, first) in zip(seqs, SEQS, strict=True) if first <= step
        ]
        # decode tokens first, as the scheduler lays a batch out
        scheduled.sort(key=lambda sn: sn[1] != 1)
        batch = shard.runner.prepare(scheduled)
        hidden = shard.runner.forward(batch).index_select(0, batch.sample_rows)
        tokens = torch.zeros(len(batch.sample_seqs), dtype=torch.long)
        logits = shard.runner.model.compute_logits(hidden)  # gathered to rank 0 only
        if tp.rank == 0:  # the driver samples; it tells the others
            tokens = logits.argmax(-1)
            out[f"logits{step}"] = logits
        else:
            assert logits is None
        tp.broadcast(tokens)
        for seq, n in scheduled:
            seq.num_computed += n
        for seq, token in zip(batch.sample_seqs, tokens.tolist(), strict=True):
            seq.tokens.append(token)
        out[f"hidden{step}"] = hidden
    out["tokens"] = torch.tensor([s.tokens[-3:] for s in seqs])
    return out


def _rank_main(rank: int, port: int, model_dir: str, adapters: list[str], out: str) -> None:
    group = TPGroup.connect(rank, 2, port, "gloo", timeout_s=120)
    save_file(_scenario(model_dir, adapters, group), f"{out}/rank{rank}.safetensors")
    group.close()


@pytest.fixture(scope="module")
def adapter_paths(llama_adapters) -> list[str]:
    return [str(llama_adapters[name]) for name in ADAPTERS]


# qwen2: q/k/v biases, sharded too; qwen3: per-head q/k norms (replicated), head_dim 24
# != hidden/heads; qwen3_bias: o's bias too (added once, after the all-reduce);
# qwen3_yarn: yarn RoPE (every rank's rotary scaled alike) past its original context;
# odd_vocab: V 383 (rank 1's shard padded), tied; mixtral: the experts split between the
# ranks (expert parallelism), attention sharded; qwen3_moe: the same with q/k norms and a
# dense MLP layer (mlp_only_layers) split by features; qwen2_moe: with its shared expert
# split as a dense MLP, each rank's gated partial joining its experts' before the one
# all-reduce
@pytest.mark.parametrize(
    ("arch", "adapters"),
    [
        ("llama",) * 2,
        ("qwen2",) * 2,
        ("qwen3",) * 2,
        ("qwen3_bias", "qwen3"),
        ("qwen3_yarn", "qwen3"),
        ("odd_vocab", "llama"),
        ("mixtral",) * 2,
        ("qwen3_moe",) * 2,
        ("qwen2_moe",) * 2,
    ],
)
def test_tp2_forward_equals_tp1(arch, adapters, request, tmp_path):
    model_dir = str(request.getfixturevalue(f"{arch}_dir"))
    fixture = request.getfixturevalue(f"{adapters}_adapters")
    paths = [str(fixture[name]) for name in SLOT_ADAPTERS[adapters]]
    ref = _scenario(model_dir, paths, SINGLE)
    args = (free_port(), model_dir, paths, str(tmp_path))
    mp.spawn(_rank_main, args=args, nprocs=2, join=True)
    ranks = [load_file(tmp_path / f"rank{r}.safetensors") for r in range(2)]
    for step in range(STEPS):
        key = f"logits{step}"
        torch.testing.assert_close(ranks[0][key], ref[key], rtol=1e-4, atol=1e-4)
        hidden = f"hidden{step}"
        torch.testing.assert_close(ranks[1][hidden], ranks[0][hidden], rtol=0, atol=0)
    assert "logits0" not in ranks[1]  # the logits are gathered to rank 0 alone
    assert ranks[0]["tokens"].tolist() == ref["tokens"].tolist()


def test_sharded_slot_buffers_hold_half(llama_dir, adapter_paths):
    from replica.models.loader import read_config

    base = read_config(Path(llama_dir)).base_shape
    whole = SlotBuffers(base, 2, 8, torch.float32, "cpu")
    halves = [SlotBuffers(base, 2, 8, torch.float32, "cpu", r, 2) for r in range(2)]
    # per group one of A, B is split (B of qkv / gate_up, A of o / down), the other whole
    per_layer = sum(
        len(outs) * h + sum(outs)
        for h, outs in (base.shard_sizes(g, 2) for g in ("qkv", "o", "gate_up", "down"))
    )
    assert all(h.nbytes == per_layer * base.num_layers * 2 * 8 * 4 for h in halves)
    assert whole.nbytes // 2 < halves[0].nbytes < whole.nbytes
    weights = load_adapter_weights(
        validate_adapter_dir(adapter_paths[0], max_rank=16, base=base), base, torch.float32
    )
    big = SlotBuffers(base, 1, 16, torch.float32, "cpu")
    parts = [SlotBuffers(base, 1, 16, torch.float32, "cpu", r, 2) for r in range(2)]
    for b in (big, *parts):
        b.write(0, weights)
    # column-parallel: B rows split; row-parallel: A columns split
    torch.testing.assert_close(torch.cat([p.b(1, "qkv")[0] for p in parts], 1), big.b(1, "qkv")[0])
    torch.testing.assert_close(
        torch.cat([p.a(1, "down")[0] for p in parts], 2), big.a(1, "down")[0]
    )
    assert parts[1].a(1, "qkv")[2].equal(big.a(1, "qkv")[2])
    assert parts[1].b(1, "o")[0].equal(big.b(1, "o")[0])


def _idle_main(rank: int, port: int) -> None:
    group = TPGroup.connect(rank, 2, port, "gloo", timeout_s=1)
    if rank == 0:
        time.sleep(2.5)  # an idle driver: longer than the rendezvous timeout
    x = group.broadcast(torch.tensor([float(rank == 0)]))
    group.close()
    group.close()  # idempotent
    assert x.item() == 1.0
    with pytest.raises(RuntimeError, match=f"rank {rank} .* has no process group"):
        group.broadcast(x)


def test_idle_driver_does_not_time_out_workers():
    """A worker waits for the next command as long as the driver stays idle."""
    mp.spawn(_idle_main, args=(free_port(),), nprocs=2, join=True)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "refused"),
    [(6, 2, "num_attention_heads=6"), (4, 1, "num_key_value_heads=1")],
)
def test_heads_not_divisible_refused(heads, kv_heads, refused):
    tp = TPGroup(0, 4, pg=object())  # no collective runs before the refusal
    with pytest.raises(InvalidRequest, match=refused):
        QKVParallelLinear(64, 8, heads, kv_heads, bias=False, tp=tp)
