"""Device-side alignment of MoE (token, choice) pairs into per-expert tiles.

The fused MoE kernels (kernels/triton/fused_moe.py) run one program per BLOCK_M rows of
one expert. This groups the T * k pairs by local expert, pads each expert's run to a
multiple of BLOCK_M and says which expert each block belongs to, never synchronising
with the host: every size is a function of (T, k, E_local, BLOCK_M), not of the routing,
so a decode step doing this is captured in a CUDA graph as is. On the Triton backend it
is two launches (kernels/triton/moe_align.py); `align_moe_ref`, the CPU path and the
reference it is tested on, is a dozen torch ops.

Pair p is (token p // k, choice p % k), expert topk_ids[t, j]; ids outside [0, E_local)
(another rank's experts) take no row. Worked example (T 3, k 2, E_local 2, BLOCK_M 2;
real tiles have BLOCK_M >= 16):
    topk_ids       [[0, 5], [1, 0], [0, 1]]   pairs 0..5 -> experts 0, -, 1, 0, 0, 1
    counts         [3, 2]                     expert 0: pairs 0, 3, 4; expert 1: 2, 5
    sorted_ids     [0, 3, 4, 6 | 2, 5 | 6, 6] padded rows; 6 (= T * k) is padding
    block_expert   [0, 0, 1, 2]               per block of BLOCK_M rows; 2 (= E_local): none
    num_blocks     [3]                        blocks with rows; max_blocks(6, 2, 2) = 4
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.backend import backend_for, moe_prep


def max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """Most blocks `pairs` pairs over `num_experts` experts can fill: each nonempty expert
    pads at most block_m - 1 rows, and each block holds at least one pair."""
    busy = min(num_experts, pairs)
    return min(pairs, (pairs + busy * (block_m - 1)) // block_m)


@dataclass(frozen=True)
class MoeAlignment:
    """Pairs grouped by expert in blocks of block_m rows (all int32, on the ids' device)."""

    sorted_ids: torch.Tensor
    """[max_blocks * block_m]: the pair id of each row, T * k for a padding row."""
    block_expert: torch.Tensor
    """[max_blocks]: the local expert of each block; E_local past num_blocks."""
    num_blocks: torch.Tensor
    """[1]: how many leading blocks hold rows (the kernels' programs past it exit)."""
    block_m: int


def align_moe(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """topk_ids: int32/int64 [T, k] (any strides) local expert ids (outside
    [0, num_experts): no work) -> MoeAlignment; pairs of one expert keep their order
    (token-major). Triton (two launches) or `align_moe_ref` by the kernels backend and
    kernels.backend.moe_prep."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"topk_ids: {topk_ids.dtype} {tuple(topk_ids.shape)}; allowed: int32/int64 [T, k]"
        )
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"num_experts {num_experts}, block_m {block_m}; allowed: both >= 1")
    dev = topk_ids.device
    if backend_for(dev) == "triton" and moe_prep() == "triton":
        from kernels.triton.moe_align import align_moe_triton

        return align_moe_triton(topk_ids, num_experts, block_m)
    return align_moe_ref(topk_ids, num_experts, block_m)


def align_moe_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """align_moe in torch ops (about a dozen launches): the CPU path and the reference."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    pairs = flat.numel()
    rows = max_blocks(pairs, num_experts, block_m) * block_m
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts)  # another rank's pairs sort last
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    blocks = (counts[:num_experts] + block_m - 1) // block_m
    block_end = blocks.cumsum(0)
    # first padded row of each expert; off-rank pairs go past `rows`, one scratch row each
    row_start = torch.cat([(block_end - blocks) * block_m, block_end.new_full((1,), rows)])
    pair_start = counts.cumsum(0) - counts  # first sorted position of each expert
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    dest = row_start[sorted_key] + torch.arange(pairs, device=dev) - pair_start[sorted_key]
    sorted_ids = torch.full((rows + pairs,), pairs, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.int())
    block_expert = torch.searchsorted(
        block_end, torch.arange(rows // block_m, device=dev), right=True, out_int32=True
    )
    return MoeAlignment(
        sorted_ids=sorted_ids[:rows],
        block_expert=block_expert,
        num_blocks=block_end[-1:].int(),
        block_m=block_m,
    )
