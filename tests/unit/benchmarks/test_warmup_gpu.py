"""benchmarks/warmup_gpu.py on the CPU (--smoke): it warms the keys the engine's graph
objects name and writes its row (the interpreter compiles nothing: the cache figures are
GPU-only)."""

from __future__ import annotations

import json

from benchmarks import warmup_gpu


def test_smoke_run_counts_the_engines_keys(tmp_path):
    out = tmp_path / "w.json"
    warmup_gpu.main(["--smoke", "--layers", "1", "--max-num-seqs", "8", "--max-loras", "4",
                     "--max-num-batched-tokens", "64", "--out", str(out)])  # fmt: skip
    row = json.loads(out.read_text())["row"]
    # decode buckets 1, 2, 4, 8 with LoRA keys {0, 1}, {0, 1, 2}, {0, 1, 2, 4} and
    # {0, 1, 2, 4}; mixed buckets 8, 16, 32, 64, each with {0, 1, 2, 4}
    assert (row["decode_keys"], row["mixed_keys"]) == (13, 16)
    assert row["keys"] == 29
    assert min(row["cold_cache_s"], row["disk_cache_s"], row["in_memory_s"]) > 0


def test_dropping_the_memory_caches_empties_the_kept_launchers():
    from kernels.testing import jit_kernels
    from kernels.triton.lora_expand import _EXPAND
    from kernels.triton.lora_shrink import _SHRINK
    from kernels.triton.paged_attention import _ATTEND

    assert {id(k) for k in (_SHRINK, _EXPAND, _ATTEND)} <= {id(k) for k in jit_kernels()}
    _SHRINK.kept["k"] = object()
    assert warmup_gpu.drop_triton_memory_caches() == 0  # the interpreter compiles nothing
    assert not _SHRINK.kept
