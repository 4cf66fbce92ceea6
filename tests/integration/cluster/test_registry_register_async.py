"""AsyncRegistry.register_adapter keeps the event loop free while it reads the adapter."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

from cluster.registry import AsyncRegistry

LAYERS, HIDDEN, RANK = 32, 8192, 64


def big_adapter(src: Path, dst: Path) -> Path:
    """A valid rank-64 q/v adapter of 32 layers x 8192 features (256 MiB of zeros, written
    sparse): reading, hashing and scanning it for NaN takes a few hundred ms."""
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.update(r=RANK, lora_alpha=2 * RANK, target_modules=["q_proj", "v_proj"])
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    header, offset = {}, 0
    for layer in range(LAYERS):
        for module in ("q_proj", "v_proj"):
            stem = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            for part, shape in (("lora_A", [RANK, HIDDEN]), ("lora_B", [HIDDEN, RANK])):
                size = 4 * shape[0] * shape[1]
                header[f"{stem}.{part}.weight"] = {
                    "dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]
                }  # fmt: skip
                offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(dst / "adapter_model.safetensors", "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        f.truncate(8 + len(blob) + offset)
    return dst


async def _longest_stall(registry: AsyncRegistry, path: Path) -> tuple[float, float]:
    """(longest gap between 5 ms ticks of another task, time the registration took)."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.05)
    start = time.perf_counter()
    rec = await registry.register_adapter("big", str(path))
    took = time.perf_counter() - start
    done.set()
    await ticker
    assert rec.rank == RANK
    return max(gaps), took


def test_registration_reads_the_adapter_off_the_event_loop(redis_url, adapters, tmp_path):
    # The ingress registers on its event loop (/v1/load_lora_adapter): reading, hashing
    # and NaN-scanning a big adapter there stalled every stream the ingress was serving.
    path = big_adapter(adapters["a"], tmp_path / "big")

    async def main() -> tuple[float, float]:
        registry = AsyncRegistry(redis_url, "t", max_lora_rank=RANK)
        try:
            return await _longest_stall(registry, path)
        finally:
            await registry.close()

    stall, took = asyncio.run(main())
    shutil.rmtree(path)
    assert took > 0.1  # the file is big enough that a stall would show
    assert stall < took / 2, (stall, took)
