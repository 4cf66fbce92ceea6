"""Assembles an engine's parts: device, model, tokenizer, KV cache, adapter slots."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.backend import backend_for, check_env
from lora_core.context import LoraBatchContext, workspace_per_token
from lora_core.errors import InvalidRequest, ModelLoadFailed
from lora_core.layers import apply_lora
from lora_core.manager import AdapterManager
from lora_core.slot_buffers import SlotBuffers
from replica.config import EngineConfig
from replica.model_runner import ModelRunner
from replica.models.config import resolve_max_model_len
from replica.models.loader import load_model
from replica.parallel import SINGLE, TPGroup
from replica.vml_warmup import warm_vector_math

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineParts:
    model_dir: Path
    tokenizer: object
    runner: ModelRunner
    adapters: object
    num_blocks: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    vocab_size: int
    close: Callable[[], None] | None = None
    """Stops what the parts started (the TP worker processes), or None."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest(
            f"device={name!r} but no CUDA device is available; allowed: 'cpu' or 'auto'"
        )
    return dev


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # noqa: BLE001 - any tokenizer failure is a model load failure
        raise ModelLoadFailed(f"cannot load the tokenizer from {model_dir}: {e}") from e


def _eos_ids(model_dir: Path, tokenizer, config_eos: tuple[int, ...]) -> frozenset[int]:
    ids = set(config_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return frozenset(ids)


@dataclass
class ModelShard:
    """What one TP rank runs: its model shard, KV cache (its kv heads) and adapter slots
    (its shard of them), wired to the runner. At tp 1 the shard is the whole model."""

    model_dir: Path
    runner: ModelRunner
    buffers: SlotBuffers
    num_blocks: int
    max_model_len: int


def build_shard(config: EngineConfig, device: torch.device, tp: TPGroup = SINGLE) -> ModelShard:
    """Load rank tp.rank's shard of config.model on `device` with its KV cache and slots."""
    # Every process that runs a model builds a shard first (a TP worker is a fresh one):
    # its first multi-threaded cos / sin must not be MKL's first call (replica.vml_warmup).
    warm_vector_math()
    check_env()
    dtype = TORCH_DTYPES[config.dtype]
    model, model_dir = load_model(config.model, dtype, device, tp)
    cfg = model.config
    max_len = resolve_max_model_len(config.max_model_len, cfg.max_position_embeddings)
    num_blocks = config.kv_blocks
    # One block more than the block manager hands out: the scratch block that padding
    # rows of CUDA-graph decode steps read and write.
    kv_heads = cfg.num_kv_heads // tp.size
    shape = (num_blocks + 1, config.block_size, kv_heads, cfg.head_dim)
    kv = [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(cfg.num_layers)
    ]
    _warm_attention(kv[0][0], cfg.num_heads // tp.size, cfg)
    buffers = SlotBuffers(
        cfg.base_shape,
        config.max_loras,
        config.max_lora_rank,
        dtype,
        device,
        tp_rank=tp.rank,
        tp_size=tp.size,
    )
    ctx = LoraBatchContext(
        config.max_num_batched_tokens,
        device,
        buffers.slot_ranks,
        workspace_per_token(cfg.base_shape, config.max_lora_rank),
        max_rank=config.max_lora_rank,
    )
    apply_lora(model.model, buffers, ctx, stacked=config.lora_stacked)
    # CUDA graphs would capture the row-parallel all-reduces; not validated under TP.
    graphs, mixed = (
        _graphs(config, model, kv, ctx, num_blocks, max_len) if tp.size == 1 else (None, None)
    )
    if config.kernel_warmup:
        warm_graph_keys(graphs, mixed, device)
    runner = ModelRunner(model, kv, config.block_size, ctx, graphs, mixed, config.dense_prompt_min)
    return ModelShard(model_dir, runner, buffers, num_blocks, max_len)


def build_engine_parts(config: EngineConfig) -> EngineParts:
    device = resolve_device(config.device)
    dtype = TORCH_DTYPES[config.dtype]
    if config.tensor_parallel_size > 1:
        from replica.tp_driver import start_tensor_parallel

        shard, close = start_tensor_parallel(config, device)
    else:
        shard, close = build_shard(config, device), None
    cfg = shard.runner.model.config
    tokenizer = load_tokenizer(shard.model_dir)
    adapters = AdapterManager(
        cfg.base_shape, shard.buffers, config.max_cpu_loras, config.max_lora_rank, dtype
    )
    return EngineParts(
        model_dir=shard.model_dir,
        tokenizer=tokenizer,
        runner=shard.runner,
        adapters=adapters,
        num_blocks=shard.num_blocks,
        max_model_len=shard.max_model_len,
        eos_token_ids=_eos_ids(shard.model_dir, tokenizer, cfg.eos_token_ids),
        vocab_size=cfg.vocab_size,
        close=close,
    )


def _warm_attention(cache: torch.Tensor, heads: int, cfg) -> None:
    """On the Triton backend, compile the paged-attention kernels' variants now (the
    model's dtype, heads, windows), not in the first step to need each (~1-2 s a
    compile in the middle of serving); later starts load them from Triton's cache."""
    if backend_for(cache.device) != "triton":
        return
    from kernels.triton.paged_attention import warm_up

    started = time.perf_counter()
    n = warm_up(heads, cache, cfg.layer_windows, cfg.head_dim**-0.5)
    log.info(
        "paged attention: %d kernel variants ready in %.1f s", n, time.perf_counter() - started
    )


def warm_graph_keys(decode, mixed, device: torch.device) -> None:
    """Compile the Triton kernels of every CUDA-graph key before serving
    (EngineConfig.kernel_warmup; DecodeGraphs.warm, MixedGraphs.warm)."""
    if decode is None and mixed is None:
        return
    started = time.perf_counter()
    keys = (decode.warm() if decode is not None else 0) + (mixed.warm() if mixed is not None else 0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    log.info(
        "kernel warm-up: the layers of %d CUDA-graph keys run once in %.1f s",
        keys, time.perf_counter() - started,
    )  # fmt: skip


def _graphs(config: EngineConfig, model, kv, ctx, num_blocks: int, max_len: int):
    """(decode graphs, mixed-step graphs) of a CUDA shard with cuda_graphs on, else Nones."""
    if not config.cuda_graphs or kv[0][0].device.type != "cuda":
        return None, None
    from replica.cuda_graphs import DecodeGraphs
    from replica.mixed_graphs import MixedGraphs

    max_blocks = -(-max_len // config.block_size)
    decode = DecodeGraphs(
        model, kv, config.block_size, ctx, num_blocks, config.max_num_seqs, max_blocks
    )
    return decode, MixedGraphs(model, kv, ctx, config.max_num_batched_tokens)
