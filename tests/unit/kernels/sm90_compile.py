"""Compile the Triton kernels for the H200 (sm_90) on a machine without a GPU.

Run as a script (without TRITON_INTERPRET, which replaces kernels by interpreted ones):
prints one JSON line {case: {"regs": int, "stack": int}} per compiled case. Tests use it
to catch GPU-only compile errors and register spills in CI, where no GPU exists. Integer
arguments are specialised the way Triton's JIT does for contiguous tensors (unit strides
as constants, the rest divisible by 16).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget

from kernels.meta import FULL_RANK
from kernels.moe_align import max_blocks
from kernels.triton.build_meta import _build_meta_kernel
from kernels.triton.fused_moe import _down_kernel, _gate_up_kernel, moe_config
from kernels.triton.lora_expand import _expand_kernel
from kernels.triton.lora_fused import _fused_kernel
from kernels.triton.lora_shrink import _shrink_kernel
from kernels.triton.lora_shrink_stream import _shrink_stream_kernel
from kernels.triton.moe_align import _count_kernel, _place_kernel, plan
from kernels.triton.moe_sum import _moe_sum_kernel, tiles
from kernels.triton.paged_attention import (
    UNMASKED_FULL,
    _combine_kernel,
    _paged_attention_kernel,
    tile_shape,
)

# B as the engine stores it: rank-major, so its n-stride is 1 (lora_core.slot_buffers)
ONE = {"stride_xh", "stride_ah", "stride_bn0", "stride_bn1", "stride_bn2", "stride_yn", "stride_bk",
       "stride_wh", "stride_hn", "stride_hi", "stride_wi", "stride_twk", "stride_k",
       "stride_ik", "stride_on"}  # fmt: skip
NOT_DIV16 = {"num_programs", "max_tiles", "ch1", "ch2", "chunks", "nt1", "nt2", "NB", "T",
             "L", "MT", "stride_t", "stride_r", "P", "E", "NC", "ROWS", "MB", "stride_it",
             "num_rows", "num_heads", "keys_per_split", "window", "stride_tab", "num_splits"}  # fmt: skip
# paged attention: block tables and decode context lengths int64 (the engine's), query
# tiles int32, the decode splits' max / sum fp32
PTR_KINDS = {"tables_ptr": "i64", "ctx_ptr": "i64", "tiles_ptr": "i32", "ml_ptr": "fp32"}
INT_PTRS = ("tile_", "num_tiles", "sync", "slots", "ranks", "scratch", "out_slots", "out_ranks",
            "sorted", "block_expert", "num_blocks", "counts")  # fmt: skip


def _signature(fn, dtype: str, consts: dict):
    sig, attrs, const = {}, {}, dict(consts)
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name in ONE:
            sig[name], const[name] = "constexpr", 1
        elif name.endswith("_ptr"):
            shrink_out = name == "out_ptr" and "shrink" in fn.__name__  # the fp32 [S, T, R]
            fp32 = "buf" in name or "part" in name or shrink_out or name == "tw_ptr"
            kind = "i32" if name.startswith(INT_PTRS) else "fp32" if fp32 else dtype
            kind = "i64" if name == "ids_ptr" else kind  # MoE routing ids (int64)
            kind = PTR_KINDS.get(name, kind)
            sig[name], attrs[(i,)] = f"*{kind}", [["tt.divisibility", 16]]
        elif name in ("scale", "qk_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name not in NOT_DIV16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, const, attrs


def compile_case(fn, dtype: str, consts: dict, warps: int, stages: int) -> dict:
    sig, const, attrs = _signature(fn, dtype, consts)
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})  # fmt: skip
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True)
    os.unlink(f.name)
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
    ptx = k.asm["ptx"]
    return {"regs": int(m.group(1)), "stack": int(m.group(2)), "shared": k.metadata.shared,
            "scalar_fp32_atomics": len(re.findall(r"\bred\.global[.\w]*\.add\.f32\b", ptx)),
            "vector_fp32_atomics": len(re.findall(r"\bred\.global[.\w]*\.add\.v[24]\.f32\b", ptx))}  # fmt: skip


def _fused(split, nsl, bm, br, bk, bn=128, ns=3):
    return dict(SPLIT=split, NS=ns, NSL=nsl, BLOCK_M=bm, BLOCK_R=br, BLOCK_K=bk, BLOCK_N=bn,
                EVEN_K=True, ADD_INPUTS=True, PRECISION="tf32")  # fmt: skip


CASES = {  # the planner's choices for Llama-3-8B layers (decode r16 / r64, prefill)
    "fused qkv r16 decode": (_fused_kernel, _fused(16, 3, 16, 16, 256), 4, 3),
    "fused qkv r64 decode": (_fused_kernel, _fused(8, 1, 16, 64, 128), 4, 3),
    "fused gate_up r16 prefill": (_fused_kernel, _fused(4, 2, 64, 16, 128, ns=2), 4, 3),
    "shrink decode": (_shrink_kernel, dict(NSL=1, BLOCK_M=16, BLOCK_R=16, BLOCK_K=128,
                      EVEN_K=True, USE_ATOMIC=True, TILE_COPIES=1, DEPENDENTS=True,
                      PRECISION="tf32", LEAN_X=True, BLOCK_S=0, TAIL=0), 2, 3),
    "shrink decode r64, 4 tile copies": (_shrink_kernel, dict(NSL=1, BLOCK_M=16, BLOCK_R=64,
                      BLOCK_K=128, EVEN_K=True, USE_ATOMIC=True, TILE_COPIES=4, DEPENDENTS=True,
                      PRECISION="tf32", LEAN_X=True, BLOCK_S=0, TAIL=0), 2, 3),
    "shrink qkv r16 decode, many adapters: q and k stacked, v its own dot": (_shrink_kernel,
                      dict(NSL=3, BLOCK_M=16, BLOCK_R=16, BLOCK_K=128, EVEN_K=True,
                      USE_ATOMIC=True, TILE_COPIES=4, DEPENDENTS=True, PRECISION="tf32",
                      LEAN_X=True, BLOCK_S=32, TAIL=1), 2, 3),
    "shrink qkv r64 decode, many adapters: q and k stacked, v its own dot": (_shrink_kernel,
                      dict(NSL=3, BLOCK_M=16, BLOCK_R=64, BLOCK_K=128, EVEN_K=True,
                      USE_ATOMIC=True, TILE_COPIES=2, DEPENDENTS=True, PRECISION="tf32",
                      LEAN_X=True, BLOCK_S=128, TAIL=1), 4, 3),
    "shrink qkv r16 prefill, 64-bit x offsets": (_shrink_kernel, dict(NSL=3, BLOCK_M=32,
                      BLOCK_R=16, BLOCK_K=128, EVEN_K=True, USE_ATOMIC=True, TILE_COPIES=2,
                      DEPENDENTS=False, PRECISION="tf32", LEAN_X=False, BLOCK_S=0, TAIL=0), 4, 3),
    "shrink qkv r16 prefill, slices stacked": (_shrink_kernel, dict(NSL=3, BLOCK_M=64,
                      BLOCK_R=16, BLOCK_K=128, EVEN_K=True, USE_ATOMIC=True, TILE_COPIES=2,
                      DEPENDENTS=False, PRECISION="tf32", LEAN_X=True, BLOCK_S=64, TAIL=0), 4, 3),
    "shrink qkv r32 T=1024, slices stacked": (_shrink_kernel, dict(NSL=3, BLOCK_M=32,
                      BLOCK_R=32, BLOCK_K=64, EVEN_K=True, USE_ATOMIC=True, TILE_COPIES=1,
                      DEPENDENTS=False, PRECISION="tf32", LEAN_X=True, BLOCK_S=128, TAIL=0), 4, 3),
    "shrink gate_up r64 prefill, slices stacked": (_shrink_kernel, dict(NSL=2, BLOCK_M=64,
                      BLOCK_R=64, BLOCK_K=64, EVEN_K=True, USE_ATOMIC=True, TILE_COPIES=2,
                      DEPENDENTS=False, PRECISION="tf32", LEAN_X=True, BLOCK_S=128, TAIL=0), 4, 3),
    "shrink qkv r64 prefill, q and k stacked, v its own dot": (_shrink_kernel, dict(NSL=3,
                      BLOCK_M=64, BLOCK_R=64, BLOCK_K=64, EVEN_K=True, USE_ATOMIC=True,
                      TILE_COPIES=2, DEPENDENTS=False, PRECISION="tf32", LEAN_X=True,
                      BLOCK_S=128, TAIL=1), 4, 3),
    "shrink stream-K r64 prefill": (_shrink_stream_kernel, dict(NSL=1, BLOCK_M=64,
                      BLOCK_R=64, BLOCK_K=128, K_STEPS=32, EVEN_K=True, DEPENDENTS=False,
                      PRECISION="tf32", LEAN_X=True), 4, 5),
    "shrink stream-K r128 T=1024 ragged K": (_shrink_stream_kernel, dict(NSL=1, BLOCK_M=32,
                      BLOCK_R=128, BLOCK_K=64, K_STEPS=71, EVEN_K=False, DEPENDENTS=False,
                      PRECISION="tf32", LEAN_X=False), 4, 5),
    "expand decode r16 after shrink": (_expand_kernel, dict(BLOCK_M=16, BLOCK_N=128, BLOCK_R=16,
                           N_ITERS=1, ADD_INPUTS=True, TILE_COPIES=1, WAIT=True, LATE_ADD=True,
                           PRECISION="tf32"), 4, 1),
    "expand prefill r64": (_expand_kernel, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_R=64,
                           N_ITERS=1, ADD_INPUTS=True, TILE_COPIES=2, WAIT=False, LATE_ADD=False,
                           PRECISION="tf32"), 4, 1),
    "expand prefill r64 2 blocks": (_expand_kernel, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_R=64,
                           N_ITERS=2, ADD_INPUTS=True, TILE_COPIES=2, WAIT=False, LATE_ADD=False,
                           PRECISION="tf32"), 4, 2),
    "expand T=1024 r16 2 blocks": (_expand_kernel, dict(BLOCK_M=32, BLOCK_N=128, BLOCK_R=16,
                           N_ITERS=2, ADD_INPUTS=True, TILE_COPIES=1, WAIT=False, LATE_ADD=False,
                           PRECISION="tf32"), 4, 2),
    "build_meta T<=4096": (_build_meta_kernel, dict(FULL=FULL_RANK, HAS_RANKS=True, BM=16,
                           PASSES=4, LOG_TP=12, CT=4096, ONE_CHUNK=True, FB=1024), 16, 1),
}  # fmt: skip


def _moe(tokens: int, dtype: str) -> dict:
    """The fused MoE kernels at moe_config's tiles for T tokens of Mixtral-8x7B (k 2, E 8)
    in dtype (fp32 takes its own, halved block_k)."""
    cfg = moe_config(tokens, 2, 8, 4 if dtype == "fp32" else 2)
    cases = {}
    for name, fn, g in (
        ("gate_up", _gate_up_kernel, cfg.gate_up),
        ("down", _down_kernel, cfg.down),
    ):
        consts = dict(TOP_K=2, BLOCK_M=cfg.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k,
                      EVEN_K=True, PRECISION="ieee" if dtype == "fp32" else "tf32")  # fmt: skip
        cases[f"moe {name} T={tokens} {dtype}"] = (fn, consts, g.num_warps, g.num_stages, dtype)
    return cases


# moe_config's four tile choices (under 1, up to 16, up to 96, more rows an expert)
for _tokens in (1, 8, 128, 512):
    for _dtype in ("bf16", "fp32"):
        CASES.update(_moe(_tokens, _dtype))


# the MoE alignment's two launches and the final sum at Mixtral-8x7B (E 8, top-2) and
# Qwen3-MoE (E 128, top-8) routings: decode, a long prefill; 256 experts (launched with
# the default 4 warps, 3 stages)
for _tokens, _k, _e in ((1, 2, 8), (8192, 2, 8), (1, 8, 128), (8192, 8, 128), (512, 8, 256)):
    _p = plan(_tokens * _k, _e, max_blocks(_tokens * _k, _e, 16), _k)
    _name = f"T={_tokens} k={_k} E={_e}"
    CASES[f"moe align count {_name}"] = (_count_kernel, _p.count, 4, 3)
    CASES[f"moe align place {_name}"] = (_place_kernel, _p.place, 4, 3)
for _tokens, _k in ((1, 2), (8192, 8)):
    _bt, _bn = tiles(_tokens, 4096)
    CASES[f"moe sum T={_tokens} k={_k}"] = (_moe_sum_kernel, dict(TOP_K=_k, BT=_bt, BN=_bn), 4, 3)


def _attention(
    group: int, decode: bool, dtype, splits: int = 1, window: bool = False, unmasked=None
) -> dict:
    """The paged-attention kernel at head size 128, 16-token blocks, as the launcher sets it."""
    t = tile_shape(group, dtype, 128, decode)
    return dict(HEAD_DIM=128, BLOCK_D=128, BS=16, GROUP=group, BLOCK_Q=t.block_q,
                BLOCK_M=t.block_m, BLOCK_N=t.block_n, DECODE=decode, SPLIT=splits > 1,
                WINDOW=window, PRECISION="ieee" if dtype == torch.float32 else "tf32",
                UNMASKED_FULL=(UNMASKED_FULL if unmasked is None else unmasked)
                and dtype != torch.float32)  # fmt: skip


_BF16, _FP32 = torch.bfloat16, torch.float32
CASES.update({  # Llama-3-8B (GQA 4), Qwen2-7B (GQA 7), a 70B (GQA 8); fp32: correctness runs
    "attention decode GQA 4": (_paged_attention_kernel, _attention(4, True, _BF16), 4, 2),
    "attention decode GQA 8, key splits, window": (_paged_attention_kernel,
                              _attention(8, True, _BF16, 8, True), 4, 2),
    "attention prefill GQA 4": (_paged_attention_kernel, _attention(4, False, _BF16), 4, 2),
    "attention prefill GQA 4, full key steps unmasked": (_paged_attention_kernel,
                              _attention(4, False, _BF16, unmasked=True), 4, 2),
    "attention decode GQA 4, full key steps unmasked": (_paged_attention_kernel,
                              _attention(4, True, _BF16, unmasked=True), 4, 2),
    "attention prefill GQA 7 fp32, window": (_paged_attention_kernel,
                              _attention(7, False, _FP32, 1, True), 4, 2, "fp32"),
    "attention decode GQA 4 fp32": (_paged_attention_kernel, _attention(4, True, _FP32), 4, 2, "fp32"),
    "attention combine": (_combine_kernel, dict(HEAD_DIM=128, BLOCK_D=128, MAX_S=16), 4, 1),
})  # fmt: skip


if __name__ == "__main__":
    out = {
        name: compile_case(fn, dt[0] if dt else "bf16", c, w, s)
        for name, (fn, c, w, s, *dt) in CASES.items()
    }
    print(json.dumps(out))
