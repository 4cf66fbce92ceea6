"""What the replicas would refuse about the model at their start, refused by `build_app`
before anything is deployed.

A replica that refuses its config at start is retried by Serve forever: `serve run` stays
up, `/v1/models` answers (the ingress starts), and every completion hangs or fails with
"failed to deploy". So the tensor-parallel split and the context length are checked here,
from the model directory `build_app` already has, with the replicas' own rules.
"""

from __future__ import annotations

from pathlib import Path

from lora_core.errors import InvalidRequest
from replica.config import EngineConfig
from replica.models.config import resolve_max_model_len
from replica.models.loader import read_config


def kv_cache_room(engine: EngineConfig) -> int:
    """Tokens the replica's KV cache holds (`EngineConfig.kv_blocks` whole blocks)."""
    return engine.kv_blocks * engine.block_size


def check_model_fits(engine: EngineConfig) -> int:
    """Refuse a tensor_parallel_size the model cannot be split over, a max_model_len past
    the model's positions, and a context the KV cache cannot hold (a request of that
    length could never run: vLLM refuses it at start too) -> the served max_model_len."""
    model = read_config(Path(engine.model))
    model.check_tensor_parallel(engine.tensor_parallel_size)
    max_len = resolve_max_model_len(engine.max_model_len, model.max_position_embeddings)
    room = kv_cache_room(engine)
    if max_len > room:
        given = "max_model_len" if engine.max_model_len else "the model's"
        raise InvalidRequest(
            f"kv_cache_tokens={engine.kv_cache_tokens}: the KV cache ({room} tokens) cannot "
            f"hold one request of the context length ({given}: {max_len}); allowed: "
            f"kv_cache_tokens >= {max_len}, or max_model_len <= {room}"
        )
    return max_len
