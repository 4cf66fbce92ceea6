"""Engine configuration: typed, validated once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lora_core.errors import InvalidRequest

DTYPES = ("float32", "bfloat16", "float16")
DENSE_PROMPT_MIN = 1024
"""EngineConfig.dense_prompt_min's default (see there)."""


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of one replica engine.

    model: a local HF model directory or a hub id present in the local HF cache.
    dtype: compute dtype; float32 on CPU, bfloat16/float16 on CUDA.
    device: "cpu", "cuda" or "cuda:N"; "auto" picks cuda when available.
    max_loras: GPU adapter slots (base requests use none).
    max_cpu_loras: adapters kept in the CPU cache (>= max_loras).
    max_lora_rank: the largest adapter rank accepted; slot buffers are this wide.
    block_size: tokens per KV block.
    num_kv_blocks: KV blocks to allocate (0 = size from kv_cache_tokens).
    kv_cache_tokens: total tokens of KV to hold when num_kv_blocks is 0.
    max_num_seqs: sequences in one running batch at most.
    max_num_batched_tokens: tokens (prefill chunks + decode) per step at most.
    max_model_len: prompt + output tokens per sequence at most (0 = the model's).
    enable_prefix_caching: share full KV blocks of equal (adapter identity, tokens) prefixes.
    seed: seeds the generator requests without a seed draw from (a run of the same
        requests in the same order is then reproducible).
    cuda_graphs: replay decode-only steps from whole-step CUDA graphs
        (`replica.cuda_graphs`), and the other steps of up to min(max_num_batched_tokens,
        2048) tokens from per-layer graphs with attention run eagerly between them
        (`replica.mixed_graphs`). CUDA devices only; not used when tensor_parallel_size > 1.
    tensor_parallel_size: devices the base model is sharded over (Megatron-style TP).
        Above 1 the engine's process is rank 0 (driver) and starts one worker process
        per further rank: on CUDA rank r uses device index (device's index) + r, so the
        process must see that many GPUs; on CPU the ranks share the CPU (gloo), for
        tests. The model's attention heads, kv heads and intermediate size (a
        mixture-of-experts model's expert count instead, and the intermediate size of its
        dense MLP layers and shared expert if it has any) must divide by it.
    tp_step_timeout_s: with tensor_parallel_size > 1, how long the driver waits for
        the workers in one step's or one adapter write's collectives. A worker that
        does not answer in time (hung, stopped) fails that step's requests and the
        replica's health check from then on, so Serve replaces the replica instead of
        it hanging. Workers wait for the driver without a limit (an idle replica).
    lora_stacked: keep the adapter slots' A under each base weight and run a LoRA
        step's shrink inside the base GEMM (`lora_core.layers`, stacked layout): faster
        where many adapters of a small-rank pool are active, slower with few adapters or
        a wide rank (`benchmarks/cublas_concat_probe.py`). tensor_parallel_size 1 only.
    dense_prompt_min: on the Triton path (CUDA), a prompt chunk with no cached keys and
        at least this many tokens attends through torch's causal SDPA on the step's own
        k / v (cuDNN or FlashAttention), not the paged kernel: whole long prompts are the
        one case where dense attention kernels are much faster than a paged one
        (`benchmarks/README.md`, "Paged attention"). Below it, one call per prompt and
        layer costs more host time than it saves. 0: every chunk paged.
    kernel_warmup: with cuda_graphs on a CUDA device (tensor_parallel_size 1), run every
        decode and mixed-step graph key's layers once at engine start, eagerly on padding
        rows, so each Triton kernel variant they launch is compiled (or loaded from
        Triton's disk cache) before the first request, not mid-serving in the first step
        to need it (~1-2 s a compile on a cold cache, every request of that step waiting).
        Start-up then takes longer by those compiles and one eager forward per key.
    """

    model: str
    dtype: str = "float32"
    device: str = "auto"
    max_loras: int = 4
    max_cpu_loras: int = 8
    max_lora_rank: int = 64
    block_size: int = 16
    num_kv_blocks: int = 0
    kv_cache_tokens: int = 65536
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0
    enable_prefix_caching: bool = True
    seed: int = 0
    cuda_graphs: bool = True
    tensor_parallel_size: int = 1
    tp_step_timeout_s: float = 300.0
    lora_stacked: bool = False
    dense_prompt_min: int = DENSE_PROMPT_MIN
    kernel_warmup: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidRequest(f"dtype={self.dtype!r}; allowed: {', '.join(DTYPES)}")
        _at_least("max_loras", self.max_loras, 1)
        _at_least("max_cpu_loras", self.max_cpu_loras, self.max_loras)
        _at_least("max_lora_rank", self.max_lora_rank, 1)
        _at_least("block_size", self.block_size, 1)
        _at_least("num_kv_blocks", self.num_kv_blocks, 0)
        _at_least("kv_cache_tokens", self.kv_cache_tokens, self.block_size)
        _at_least("max_num_seqs", self.max_num_seqs, 1)
        _at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _at_least("max_model_len", self.max_model_len, 0)
        _at_least("tensor_parallel_size", self.tensor_parallel_size, 1)
        _at_least("dense_prompt_min", self.dense_prompt_min, 0)
        if self.lora_stacked and self.tensor_parallel_size > 1:
            raise InvalidRequest(
                f"lora_stacked with tensor_parallel_size={self.tensor_parallel_size}; "
                "allowed: lora_stacked only with tensor_parallel_size 1"
            )
        timeout = self.tp_step_timeout_s
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout < math.inf
        ):
            raise InvalidRequest(
                f"tp_step_timeout_s={timeout!r}; allowed: a finite number of seconds > 0"
            )

    @property
    def kv_blocks(self) -> int:
        """KV blocks the block manager hands out: num_kv_blocks, else kv_cache_tokens in
        whole blocks, rounded up."""
        return self.num_kv_blocks or -(-self.kv_cache_tokens // self.block_size)


def _at_least(name: str, value: int, low: int) -> None:
    if not isinstance(value, int) or value < low:
        raise InvalidRequest(f"{name}={value!r}; allowed: an integer >= {low}")
