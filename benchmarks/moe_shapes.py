"""The MoE layer shapes `benchmarks/moe_gpu.py` times (`--shape`), their routing and
byte floor, and the tile configs its `--sweep` tries (pure: no GPU needed).

mixtral: Mixtral-8x7B (H 4096, I 14336, 8 experts, top-2, top-k weights renormalised).
qwen3-moe: Qwen3-30B-A3B (H 2048, moe_intermediate_size 768, 128 experts, top-8,
norm_topk_prob). qwen2-moe: Qwen1.5-MoE-A2.7B (H 2048, moe_intermediate_size 1408, 60
experts, top-4, norm_topk_prob false); its shared expert is a dense MLP outside
`kernels.fused_moe`, not timed here. The small-expert shapes add T = 2048: with 128
experts and top-8 an expert has T / 16 rows on average, under one until T = 16.

Sweep, per T: the block heights up to twice the mean rows per expert (T k / E; 16
always), and at each every gate_up tile (with moe_config's down tile), then every down
tile (with the best gate_up). A tile is (block_n, block_k); warps and stages follow from
it (`gemm_tile`). Worked example, qwen3-moe at T = 512: 32 rows an expert -> heights
16, 32, 64; at 64 rows the gate_up tile (64, 256) needs (64 + 2 x 64) x 256 x 2 B = 96 KB
of shared memory a stage, so it gets 2 stages; (128, 256), 160 KB a stage, is not tried.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kernels.triton.fused_moe import GemmConfig, MoeConfig, moe_config

EL = 2  # bf16 bytes
SMEM = 232448  # shared memory an sm_90 block may use (227 KB)
BLOCK_HEIGHTS = (16, 32, 64, 128)
DENSE_MAX_ROWS = 65536  # E x T past which the dense-masked path is not timed
# rough seconds a Triton compile (these kernels took 1.2-2.5 s each for sm_90 on the 2-core
# development machine) and a graph timing (a capture and 25 ms of replays) cost
COMPILE_S, TIMING_S = 1.5, 0.15


@dataclass(frozen=True)
class MoeShape:
    """One MoE layer's routed experts and the sweep's tiles for them."""

    model: str
    """The checkpoint the sizes are taken from."""
    hidden: int
    """H."""
    inter: int
    """I: one expert's intermediate size (moe_intermediate_size for Qwen)."""
    experts: int
    """E."""
    top_k: int
    """k: experts per token."""
    normalize: bool
    """The top-k weights are renormalised to sum to 1 (Mixtral; Qwen's norm_topk_prob)."""
    tokens: tuple[int, ...]
    """The T list run by default."""
    gate_up_tiles: tuple[tuple[int, int], ...]
    """(block_n, block_k) of the gate_up GEMM the sweep tries."""
    down_tiles: tuple[tuple[int, int], ...]
    """(block_n, block_k) of the down GEMM the sweep tries."""

    @property
    def expert_bytes(self) -> int:
        """Gate, up and down rows of one expert, bf16."""
        return 3 * self.inter * self.hidden * EL


_NARROW_GATE_UP = tuple(itertools.product((32, 64, 128), (64, 128, 256)))
_NARROW_DOWN = tuple(itertools.product((64, 128), (64, 128, 256)))
SHAPES = {
    "mixtral": MoeShape("Mixtral-8x7B", 4096, 14336, 8, 2, True, (1, 8, 32, 128, 512),
                        ((64, 128), (128, 64), (64, 64)), ((32, 128), (64, 128), (128, 64))),
    "qwen3-moe": MoeShape("Qwen3-30B-A3B", 2048, 768, 128, 8, True,
                          (1, 8, 32, 128, 512, 2048), _NARROW_GATE_UP, _NARROW_DOWN),
    "qwen2-moe": MoeShape("Qwen1.5-MoE-A2.7B", 2048, 1408, 60, 4, False,
                          (1, 8, 32, 128, 512, 2048), _NARROW_GATE_UP, _NARROW_DOWN),
}  # fmt: skip


def routing(
    shape: MoeShape, tokens: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random router on gen's device: softmax top-k of random logits -> (weights float32
    [T, k], renormalised where the shape's model does; expert ids int64 [T, k])."""
    logits = torch.randn(tokens, shape.experts, device=gen.device, generator=gen)
    w, ids = torch.topk(torch.softmax(logits, -1), shape.top_k, dim=-1)
    return (w / w.sum(-1, keepdim=True) if shape.normalize else w), ids


def floor_bytes(shape: MoeShape, tokens: int, ids: torch.Tensor) -> dict[str, int]:
    """The experts ids [T, k] touch, read whole, plus x read and y written once (bf16)."""
    touched = int(ids.unique().numel())
    return {"experts_touched": touched, "bytes": touched * shape.expert_bytes + 2 * tokens * shape.hidden * EL}  # fmt: skip


def dense_skip(shape: MoeShape, tokens: int) -> str | None:
    """Why the dense-masked path (every expert on every token) is not timed at T, or None."""
    rows = shape.experts * tokens
    if rows <= DENSE_MAX_ROWS:
        return None
    return (f"E x T = {rows} expert rows > {DENSE_MAX_ROWS}: {shape.experts / shape.top_k:g}x "
            f"the routed FLOPs and a {rows * 2 * shape.inter * EL / 1e9:.1f} GB [E, T, 2I] activation")  # fmt: skip


def block_heights(shape: MoeShape, tokens: int) -> list[int]:
    """Block heights worth a try at T: up to twice the mean rows per expert, 16 always."""
    per_expert = tokens * shape.top_k / shape.experts
    return [m for m in BLOCK_HEIGHTS if m == 16 or m <= 2 * per_expert]


def gemm_tile(block_m: int, block_n: int, block_k: int, weights: int) -> GemmConfig | None:
    """The (block_n, block_k) tile at block_m rows, of a GEMM streaming `weights` weight
    tiles a step (gate_up 2, down 1): 8 warps where block_m or block_n is 128 (4 spill
    gate_up's two accumulators at 128 rows on sm_90), else 4; 4 stages (3 at 128 rows),
    fewer while their shared-memory buffers pass SMEM; None where 2 stages do not fit.
    Buffers, as Triton 3.9 compiles these kernels for sm_90: one a stage from 64 rows
    (wgmma), one fewer below (mma.sync: a 16-row gate_up (64, 256) at 4 stages takes 3)."""
    warps = 8 if 128 in (block_m, block_n) else 4
    stage = (block_m + weights * block_n) * block_k * EL
    for stages in range(3 if block_m == 128 else 4, 1, -1):
        if (stages - (block_m < 64)) * stage <= SMEM:
            return GemmConfig(block_n, block_k, warps, stages)
    return None


def gate_up_configs(shape: MoeShape, tokens: int, block_m: int) -> list[MoeConfig]:
    """The gate_up tiles that fit at block_m, each with moe_config's down tile at T."""
    down = moe_config(tokens, shape.top_k, shape.experts).down
    tiles = [gemm_tile(block_m, n, k, 2) for n, k in shape.gate_up_tiles]
    return [MoeConfig(block_m, g, down) for g in tiles if g is not None]


def down_configs(shape: MoeShape, block_m: int, gate_up: GemmConfig) -> list[MoeConfig]:
    """The down tiles that fit at block_m, each after the given gate_up tile."""
    tiles = [gemm_tile(block_m, n, k, 1) for n, k in shape.down_tiles]
    return [MoeConfig(block_m, gate_up, d) for d in tiles if d is not None]


def sweep_plan(shape: MoeShape, token_list: list[int]) -> dict[str, float]:
    """What --sweep over token_list costs: {timings, compiles, estimate_s}. Compiles count
    distinct kernels: (GEMM, block_m, tile, whether T k divides by 16, which Triton
    specialises on); each is a guess of COMPILE_S, each timing TIMING_S."""
    timings, kernels = 0, set()
    for tokens in token_list:
        p16 = tokens * shape.top_k % 16 == 0
        for bm in block_heights(shape, tokens):
            gu = gate_up_configs(shape, tokens, bm)
            dn = down_configs(shape, bm, gu[0].gate_up)
            timings += len(gu) + len(dn)
            kernels |= {("gate_up", bm, c.gate_up, p16) for c in gu}
            kernels |= {("down", bm, c.down, p16) for c in gu[:1] + dn}
    return {"timings": timings, "compiles": len(kernels),
            "estimate_s": len(kernels) * COMPILE_S + timings * TIMING_S}  # fmt: skip
