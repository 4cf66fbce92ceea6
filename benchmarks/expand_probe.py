"""Where an expand's time goes (GPU): kernels.lora_expand beside kernels with its exact
tiles and grid (SegmentMeta tiles of gathered token rows, column groups of n_iters blocks
of block_n, the default ExpandConfig) that do less of its work:

  copy     y[rows, cols] += 1: only the y read and write
  loads    every byte the expand moves (y, B up to the slot's rank, its shrink rows),
           B and the shrink rows consumed by sums: no tensor-core dot, no accumulator
  dot      the expand's dot and add, as the library kernel, without its slice picking
  expand   kernels.lora_expand
  torch    y.add_(1) on contiguous y (the same bytes in one streaming pass)

single-slice layers (o, down), bf16, B rank-major, CUDA-graph replay, inputs rotated past L2.

    python3 benchmarks/expand_probe.py --out benchmarks/results/expand_probe_h200.json

A probe, not a kernel of the library (benchmarks/README.md, "Probes").
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lora_bench import (  # noqa: E402
    Pools,
    call_expand,
    expand_err,
    floor_bytes,
    make_sets,
    num_sets,
    probe_header,
    time_graph,
)

from kernels.meta import tile_programs  # noqa: E402
from kernels.triton.common import block_r  # noqa: E402
from kernels.triton.lora_expand import default_config  # noqa: E402
from kernels.triton.tiles import load_tile  # noqa: E402

SHAPES = [  # layer, rank, T, n
    ("o", 64, 4096, 1),
    ("o", 64, 4096, 32),
    ("o", 16, 4096, 8),
    ("down", 64, 4096, 8),
    ("o", 64, 1024, 8),
    ("o", 64, 256, 32),
    ("o", 16, 64, 8),
]
MODES = ("copy", "loads", "dot")


@triton.jit
def _probe_kernel(
    y_ptr, buf_ptr, b_ptr, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, num_tiles_ptr,
    num_programs, N, stride_yt, stride_bl, stride_br, stride_bt, R,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    N_ITERS: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    """MODE 0 (copy): y += 1. MODE 1 (loads): y += rowsum(h) + colsum(B). MODE 2 (dot):
    y += h @ B. h = buf[0, tok, :rank], B = B[slot, :rank, cols] (rank-major)."""
    offs_n0 = tl.program_id(0) * (N_ITERS * BLOCK_N) + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    for tile in range(tl.program_id(1), tl.load(num_tiles_ptr), num_programs):
        slot, rank, tok, m_mask = load_tile(
            tile, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, R, BLOCK_M
        )
        if slot >= 0:
            r_mask = offs_r < rank
            h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            if MODE > 0:
                h = tl.load(buf_ptr + tok[:, None] * stride_bt + offs_r[None, :],
                            mask=m_mask[:, None] & r_mask[None, :], other=0.0)  # fmt: skip
            b_slot = b_ptr + slot.to(tl.int64) * stride_bl
            for j in range(N_ITERS):
                offs_n = offs_n0 + j * BLOCK_N
                n_mask = offs_n < N
                ptrs = y_ptr + tok[:, None] * stride_yt + offs_n[None, :]
                mask = m_mask[:, None] & n_mask[None, :]
                y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
                if MODE == 0:
                    y += 1.0
                else:
                    b = tl.load(b_slot + offs_r[:, None] * stride_br + offs_n[None, :],
                                mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # fmt: skip
                    if MODE == 1:
                        y += tl.sum(h, 1)[:, None] + tl.sum(b.to(tl.float32), 0)[None, :]
                    else:
                        y += tl.dot(h.to(b.dtype), b)
                tl.store(ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _stream_kernel(
    y_ptr, buf_ptr, b_ptr, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, num_tiles_ptr,
    stride_yt, stride_bl, stride_br, stride_bt, R,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, COLS: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """The expand as a persistent pipelined loop: the (tile, column block) items of the
    tiles with work, tile-major, cut into equal runs, one per program; each item's loads
    (tile rows, y, B, shrink rows) are issued STAGES - 1 items ahead. N = COLS * BLOCK_N."""
    total = tl.load(num_tiles_ptr) * COLS
    per = tl.cdiv(total, tl.num_programs(0))
    start = tl.program_id(0) * per
    end = tl.minimum(start + per, total)
    offs_r = tl.arange(0, BLOCK_R)
    for i in tl.range(start, end, num_stages=STAGES):
        tile = i // COLS
        offs_n = (i - tile * COLS) * BLOCK_N + tl.arange(0, BLOCK_N)
        slot, rank, tok, m_mask = load_tile(
            tile, tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, R, BLOCK_M
        )
        r_mask = offs_r < rank
        ptrs = y_ptr + tok[:, None] * stride_yt + offs_n[None, :]
        y = tl.load(ptrs, mask=m_mask[:, None], other=0.0)
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_bl + offs_r[:, None] * stride_br
                    + offs_n[None, :], mask=r_mask[:, None], other=0.0)  # fmt: skip
        h = tl.load(buf_ptr + tok[:, None] * stride_bt + offs_r[None, :],
                    mask=m_mask[:, None] & r_mask[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(h.to(b.dtype), b, acc=y.to(tl.float32))
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None])


def _stream(st: dict, per_sm: int, block_n: int, stages: int, warps: int) -> None:
    y, buf, meta = st["y"], st["buf"], st["meta"]
    b = st["pool"].b[0]
    rank = b.shape[2]
    assert y.shape[1] % block_n == 0
    sms = torch.cuda.get_device_properties(y.device).multi_processor_count
    _stream_kernel[(per_sm * sms,)](
        y, buf, b, meta.tile_slot, meta.tile_rank, meta.tile_tok, meta.num_tiles,
        y.stride(0), b.stride(0), b.stride(2), buf.stride(1), rank,
        BLOCK_M=meta.block_m, BLOCK_N=block_n, BLOCK_R=block_r(rank),
        COLS=y.shape[1] // block_n, STAGES=stages, num_warps=warps, num_stages=stages,
    )  # fmt: skip


STREAM_CONFIGS = [(2, 128, 3, 4), (2, 128, 2, 4), (3, 64, 3, 4), (4, 64, 3, 4), (2, 128, 3, 8),
                  (1, 256, 2, 8), (4, 128, 3, 4)]  # fmt: skip
"""(programs per SM, block_n, stages, warps) of the persistent pipelined expand probe."""


def _check_stream(st: dict, cfg) -> None:
    """The stream probe writes what kernels.lora_expand writes (bf16 rounding apart)."""
    err = expand_err(st, partial(_stream, st, *cfg))
    if err > 1e-2:
        raise AssertionError(f"stream {cfg}: relative error {err:.3g} against lora_expand")


def _probe(st: dict, mode: int) -> None:
    y, buf, meta = st["y"], st["buf"], st["meta"]
    b = st["pool"].b[0]  # [L, N, R] view of rank-major [L, R, N] memory
    rank = b.shape[2]
    cfg = default_config(meta.block_m, block_r(rank), b.shape[1])
    programs = tile_programs(y.shape[0], meta.num_slots, meta.block_m)
    groups = triton.cdiv(y.shape[1], cfg.block_n * cfg.n_iters)
    _probe_kernel[(groups, programs)](
        y, buf, b, meta.tile_slot, meta.tile_rank, meta.tile_tok, meta.num_tiles, programs,
        y.shape[1], y.stride(0), b.stride(0), b.stride(2), buf.stride(1), rank,
        BLOCK_M=meta.block_m, BLOCK_N=cfg.block_n, BLOCK_R=block_r(rank), N_ITERS=cfg.n_iters,
        MODE=mode, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def probe(bw: float) -> list[dict]:
    rows = []
    for layer, rank, tokens, n in SHAPES:
        fb = floor_bytes(layer, tokens, n, rank, rank)
        pools = Pools(layer, rank)
        sets, _ = make_sets(layer, pools, tokens, n, num_sets(fb), lambda i, r=rank: r)
        assert sets[0]["pool"].b[0].stride(1) == 1, "B rank-major"
        row = {"shape": f"{layer} r{rank} T={tokens} n={n}", "floor_us": fb["expand"] / bw * 1e6}
        row["copy_floor_us"] = 2 * sets[0]["y"].numel() * 2 / bw * 1e6
        for mode, name in enumerate(MODES):
            row[f"{name}_us"] = time_graph([partial(_probe, st, mode) for st in sets], 10)
        row["expand_us"] = time_graph([partial(call_expand, st) for st in sets], 10)
        for cfg in STREAM_CONFIGS:
            try:
                _check_stream(sets[0], cfg)
                row[f"stream{cfg}_us"] = time_graph([partial(_stream, st, *cfg) for st in sets], 10)
            except AssertionError:
                raise
            except Exception as err:  # noqa: BLE001 - a config past shared memory: data too
                print(f"  stream {cfg}: {type(err).__name__}", flush=True)
        row["torch_us"] = time_graph([partial(torch.Tensor.add_, st["y"], 1.0) for st in sets], 10)
        print(
            f"{row['shape']:22s} floor {row['floor_us']:6.1f} | torch {row['torch_us']:6.1f} | "
            + " | ".join(f"{m} {row[f'{m}_us']:6.1f}" for m in (*MODES, "expand"))
            + " | stream "
            + " ".join(f"{row.get(f'stream{c}_us', float('nan')):.1f}" for c in STREAM_CONFIGS),
            flush=True,
        )
        rows.append(row)
        del sets, pools
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    bw, result = probe_header()
    result["rows"] = probe(bw)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
