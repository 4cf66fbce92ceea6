"""The segmented expand in Gluon (Triton's explicit-layout dialect), for 16-bit y on CUDA.

Semantics, grid and arguments are lora_expand._expand_kernel's (column groups of all
slices x tile programs; each (tile, column) written by one program). What differs is
where the bytes go inside a program. The Triton kernel loads old y in a coalesced
layout and moves it into the tensor-core accumulator layout, and the sum back out,
through shared memory (two round trips per block), and the shrink rows (fp32) through
shared memory into the dot-operand layout. Here old y is loaded, summed into and stored
from the accumulator layout itself, and the shrink rows are loaded straight into the
dot-operand layout: only B passes through shared memory. 16- and 32-row tiles run
mma_v2 (warps_m x warps_n warps); 64-row tiles run Hopper's wgmma (one warpgroup) where
the GPU has it.

Used by lora_expand_triton where `available(device, dtype)` and ExpandConfig.gluon; the
Triton kernel stays the path for fp32, the CPU interpreter and Triton builds without
Gluon (the language is experimental: the names used here are those of Triton 3.6-3.9).
"""

from __future__ import annotations

import functools

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
    )

    GLUON = True
except ImportError:  # a Triton without Gluon: the Triton kernel only
    GLUON = False


@functools.lru_cache(maxsize=8)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Gluon kernels compile here: CUDA sm_80+, 16-bit y, a Triton with Gluon."""
    return (
        GLUON
        and device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and _capability(device) >= (8, 0)
    )


def use_wgmma(device: torch.device, block_m: int) -> bool:
    """64-row tiles on sm_90 take the wgmma kernel (one warpgroup)."""
    return block_m == 64 and _capability(device) == (9, 0)


if GLUON:
    # Triton 3.6 names (3.9's): a CTA-wide barrier thread_barrier (barrier), a cp.async
    # copy into shared memory async_copy_global_to_shared (async_load)
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    copy_to_shared = (
        getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    )

    @gluon.jit
    def _pick(s, v0, v1, v2):
        return gl.where(s == 0, v0, gl.where(s == 1, v1, v2))

    @gluon.jit
    def _gdc_wait():
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )

    @gluon.jit
    def _expand_gluon_kernel(
        y_ptr, buf_ptr, b_ptr,
        tile_slot_ptr, tile_rank_ptr, tile_tok_ptr, num_tiles_ptr, num_programs,
        b_off1, b_off2, stride_bl0, stride_bl1, stride_bl2, stride_bn0, stride_bn1, stride_bn2,
        stride_br0, stride_br1, stride_br2,
        n0, n1, n2, nt1, nt2,
        stride_yt, stride_yn, stride_bs, stride_bt, stride_bk,
        R,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_R: gl.constexpr,
        N_ITERS: gl.constexpr, ADD_INPUTS: gl.constexpr, WAIT: gl.constexpr,
        MMA: gl.constexpr, B_SHARED: gl.constexpr, WGMMA: gl.constexpr, ASYNC_B: gl.constexpr,
    ):  # fmt: skip
        """lora_expand._expand_kernel's semantics: for the tiles of this tile program and
        the N_ITERS column blocks of this column group (slice s),
            y[t, off_s + n] = (y[t, off_s + n] if ADD_INPUTS else 0)
                              + sum_{r < rank[slot]} B_s[slot, n, r] * buf[s, t, r].
        MMA: the accumulator layout (mma_v2, or wgmma with WGMMA); B_SHARED: B's shared
        layout. WAIT: a programmatic dependent of the shrink that writes buf. ASYNC_B: B's
        N_ITERS blocks are copied into shared memory asynchronously (cp.async, no
        registers), all issued before the first block's dot; else loaded through registers
        into one shared buffer, block by block."""
        H_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        B_LD: gl.constexpr = gl.BlockedLayout(
            size_per_thread=[1, 8], threads_per_warp=[4, 8],
            warps_per_cta=[gl.num_warps(), 1], order=[1, 0],
        )  # fmt: skip
        pid_n = gl.program_id(0)
        s = (pid_n >= nt1).to(gl.int32) + (pid_n >= nt2).to(gl.int32)
        n_s = _pick(s, n0, n1, n2)
        col0 = _pick(s, 0, n0, n0 + n1).to(gl.int64)
        first = (pid_n - _pick(s, 0, nt1, nt2)) * (N_ITERS * BLOCK_N)
        b_slice = b_ptr + _pick(s, 0, b_off1, b_off2).to(gl.int64)
        stride_bl = _pick(s, stride_bl0, stride_bl1, stride_bl2).to(gl.int64)
        stride_bn = _pick(s, stride_bn0, stride_bn1, stride_bn2)
        stride_br = _pick(s, stride_br0, stride_br1, stride_br2)
        buf_s = buf_ptr + s.to(gl.int64) * stride_bs

        offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))
        offs_mh = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, H_OP))
        offs_rh = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, H_OP))
        offs_rb = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, B_LD))
        NB: gl.constexpr = N_ITERS if ASYNC_B else 1
        b_smem = gl.allocate_shared_memory(b_ptr.dtype.element_ty, [NB, BLOCK_R, BLOCK_N], B_SHARED)
        for tile in range(gl.program_id(1), gl.load(num_tiles_ptr), num_programs):
            slot = gl.load(tile_slot_ptr + tile)
            rank = gl.minimum(gl.load(tile_rank_ptr + tile), R)
            if slot >= 0:
                tok_raw = gl.load(tile_tok_ptr + tile * BLOCK_M + offs_m)
                m_mask = tok_raw >= 0
                tok = gl.where(m_mask, tok_raw, 0).to(gl.int64)
                tok_h = gl.load(tile_tok_ptr + tile * BLOCK_M + offs_mh)
                h_rows = buf_s + gl.where(tok_h >= 0, tok_h, 0).to(gl.int64) * stride_bt
                b_slot = b_slice + slot.to(gl.int64) * stride_bl
                b_mask_r = (offs_rb < rank)[:, None]
                if ASYNC_B:
                    cta_barrier()  # every warp is done reading the previous tile's B
                    for j in gl.static_range(N_ITERS):
                        offs_nb = (
                            first
                            + j * BLOCK_N
                            + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, B_LD))
                        )
                        copy_to_shared(
                            b_smem.index(j),
                            b_slot + offs_rb[:, None] * stride_br + offs_nb[None, :] * stride_bn,
                            mask=b_mask_r & (offs_nb < n_s)[None, :],
                        )
                        async_copy.commit_group()
                for j in gl.static_range(N_ITERS):
                    offs_n = (
                        first + j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
                    )
                    offs_nb = (
                        first + j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, B_LD))
                    )
                    y_ptrs = y_ptr + tok[:, None] * stride_yt + (col0 + offs_n)[None, :] * stride_yn
                    mask = m_mask[:, None] & (offs_n < n_s)[None, :]
                    if ADD_INPUTS:  # issued first: the y read overlaps the B read
                        acc = gl.load(y_ptrs, mask=mask, other=0.0).to(gl.float32)
                    else:
                        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
                    if not ASYNC_B:
                        b_ptrs = (
                            b_slot + offs_rb[:, None] * stride_br + offs_nb[None, :] * stride_bn
                        )
                        b = gl.load(b_ptrs, mask=b_mask_r & (offs_nb < n_s)[None, :], other=0.0)
                    if j == 0:
                        if WAIT:  # the shrink's output is read from here on
                            _gdc_wait()
                        # loaded by the pool's rank R (a mask constant over column pairs:
                        # 8-byte loads), then zeroed from the slot's rank on
                        h = gl.load(h_rows[:, None] + offs_rh[None, :] * stride_bk,
                                    mask=(tok_h >= 0)[:, None] & (offs_rh < R)[None, :],
                                    other=0.0)  # fmt: skip
                        h = gl.where((offs_rh < rank)[None, :], h, 0.0).to(y_ptr.dtype.element_ty)
                    if ASYNC_B:
                        async_copy.wait_group(N_ITERS - 1 - j)  # this thread's copies of block j
                        b_j = b_smem.index(j)
                    else:
                        cta_barrier()  # every warp is done reading the previous B block
                        b_j = b_smem.index(0)
                        b_j.store(b)
                    if WGMMA:
                        fence_async_shared()
                        cta_barrier()
                        acc = warpgroup_mma(h, b_j, acc)
                    else:
                        cta_barrier()
                        acc = mma_v2(h, b_j.load(B_OP), acc)
                    gl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
        if WAIT:  # also programs without work: this kernel ends only after the shrink has
            _gdc_wait()


@functools.lru_cache(maxsize=64)
def layouts(block_m: int, block_n: int, num_warps: int, wgmma: bool, bits: int = 16):
    """(accumulator layout, B's shared layout) of a launch: wgmma (one warpgroup) or
    mma_v2 with up to one warp per 16 rows, the rest along the columns."""
    if wgmma:
        mma = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_n, 16]
        )
        # B [BLOCK_R, BLOCK_N], columns contiguous: the widest swizzle their bytes allow
        row_bytes = block_n * bits // 8
        swizzle = next(w for w in (128, 64, 32, 0) if w == 0 or row_bytes % w == 0)
        return mma, gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=bits, rank=2)
    warps_m = min(block_m // 16, 2, num_warps)
    mma = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[warps_m, num_warps // warps_m], instr_shape=[16, 8]
    )
    return mma, gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
