"""The engine's adapter glue: validate + load (disk -> CPU), residency (`SlotPool`), slot copies.

Every error an adapter can cause (bad files, does not fit, changed on disk) is raised
before the pool or any slot is touched. Calls are serialised by one lock, so admin
calls (pin, unload) may come from another thread than the engine loop; slots of
running requests are never written (the pool never evicts them).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from lora_core.adapter_files import read_adapter_files
from lora_core.base_shape import BaseShape
from lora_core.errors import AdapterDraining, AdapterLoadFailed
from lora_core.identity import AdapterRef
from lora_core.pool import (
    DROP_CPU,
    EVICT_SLOT,
    FORGET,
    LOAD_CPU,
    LOAD_SLOT,
    PoolAction,
    PoolStats,
    SlotPool,
)
from lora_core.slot_buffers import SlotBuffers
from lora_core.validate import AdapterManifest, validate_adapter_files
from lora_core.weights import AdapterWeights, load_adapter_weights


class AdapterManager:
    """Adapters of one replica: CPU cache of packed weights + GPU slots in `buffers`."""

    def __init__(
        self,
        base: BaseShape,
        buffers: SlotBuffers,
        max_cpu_loras: int,
        max_rank: int,
        dtype: torch.dtype,
    ):
        if max_rank > buffers.max_rank:
            raise ValueError(f"max_rank={max_rank}; allowed: <= the slot width {buffers.max_rank}")
        self.base = base
        self.buffers = buffers
        self.max_rank = max_rank
        self.dtype = dtype
        self.pool = SlotPool(buffers.max_loras, max_cpu_loras)
        self._manifests: dict[str, AdapterManifest] = {}
        self._cpu: dict[str, AdapterWeights] = {}
        self._lock = threading.RLock()
        # One loader thread: disk reads, hashing and unpacking release the GIL, so they
        # overlap with the engine's steps.
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-loader")

    def close(self) -> None:
        """Stop the loader thread (pending prefetches finish first)."""
        self._loader.shutdown(wait=True)

    def register(self, ref: AdapterRef) -> AdapterManifest:
        """Validate ref's directory against the base, load it into the CPU cache (if room).

        Idempotent per ref.key. Raises AdapterLoadFailed / AdapterIncompatible (nothing
        changed then), AdapterDraining while an unload of this key is in progress.
        """
        with self._lock:
            if ref.key in self.pool:
                self._run(self.pool.add(ref.key, ref.name), {})
                return self._manifests[ref.key]
        # One read of the files: the bytes validated are the bytes loaded, hashed once.
        files = read_adapter_files(ref.path)
        manifest = validate_adapter_files(files, max_rank=self.max_rank, base=self.base)
        if ref.content_hash and manifest.content_hash != ref.content_hash:
            raise AdapterLoadFailed(
                f"{ref.path}: content hash {manifest.content_hash[:16]} is not the registered "
                f"{ref.content_hash[:16]} of {ref.key}; allowed: re-register the adapter"
            )
        weights = load_adapter_weights(manifest, self.base, self.dtype, files)
        with self._lock:
            if ref.key not in self.pool:
                self._manifests[ref.key] = manifest
            self._run(self.pool.add(ref.key, ref.name), {ref.key: weights})
            return self._manifests[ref.key]

    def fetch(self, ref: AdapterRef) -> AdapterManifest:
        """register(ref), then read it back into the CPU cache if it had been dropped from
        there. The async front calls this outside the engine lock before queueing a
        request, so that disk read overlaps with running steps; left to acquire, it ran
        under the engine lock and stalled every running request for its duration."""
        manifest = self.register(ref)
        self._prefetch(ref.key)
        return manifest

    def register_async(self, ref: AdapterRef) -> Future[AdapterManifest]:
        """register(ref) on the loader thread; the future raises what register raises."""
        return self._loader.submit(self.register, ref)

    def prefetch(self, ref: AdapterRef) -> Future[None]:
        """Read a registered adapter dropped from the CPU cache back in, in the background,
        so a later acquire copies from CPU instead of reading the disk."""
        return self._loader.submit(self._prefetch, ref.key)

    def _prefetch(self, key: str) -> None:
        with self._lock:
            if key in self._cpu or key not in self.pool:
                return
            manifest = self._manifests[key]
        weights = load_adapter_weights(manifest, self.base, self.dtype)
        with self._lock:
            if key in self.pool and key not in self._cpu:
                try:
                    actions = self.pool.cache(key)
                except AdapterDraining:
                    return  # unloaded while we read it: nothing to cache
                self._run(actions, {key: weights})

    def can_admit(self, ref: AdapterRef) -> bool:
        """A request for ref may take its slot now: acquire(ref) would succeed and ref's
        slot is not yielding to an adapter that waits for one (`SlotPool.yields_slot`).
        False: wait. AdapterNotFound/AdapterDraining: fail."""
        with self._lock:
            return self.pool.can_admit(ref.key) and not self.pool.yields_slot(ref.key)

    def acquire(self, ref: AdapterRef) -> int:
        """The GPU slot holding ref for one more running request (copied in if needed)."""
        with self._lock:
            preloaded = self._preload_if_on_disk(ref.key)
            slot, actions = self.pool.acquire(ref.key)
            self._run(actions, preloaded)
            return slot

    def release(self, ref: AdapterRef) -> None:
        with self._lock:
            self._run(self.pool.release(ref.key), {})

    def want(self, ref: AdapterRef) -> None:
        """A request queued for ref waits for a slot (the scheduler's AdapterDemand)."""
        with self._lock:
            self.pool.want(ref.key)

    def unwant(self, ref: AdapterRef) -> None:
        """A request that waited for ref got its slot, failed or was aborted."""
        with self._lock:
            self.pool.unwant(ref.key)

    def pin(self, ref: AdapterRef) -> int:
        """Keep ref in a GPU slot until unpinned; returns the slot."""
        with self._lock:
            preloaded = self._preload_if_on_disk(ref.key)
            self._run(self.pool.pin(ref.key), preloaded)
            slot = self.pool.slot_of(ref.key)
            assert slot is not None, "a pinned adapter is resident"
            return slot

    def unpin(self, ref_or_name: AdapterRef | str) -> None:
        """Unpin one version (a ref), or every version of a name (a str)."""
        target = ref_or_name.key if isinstance(ref_or_name, AdapterRef) else ref_or_name
        with self._lock:
            self._run(self.pool.unpin(target), {})

    def prefetch_to_gpu(self, ref: AdapterRef) -> int | None:
        """Warm ref into a GPU slot (evicting only an idle unpinned adapter) without
        holding it; the slot, or None when every slot is busy now."""
        with self._lock:
            if not self.pool.can_admit(ref.key):
                return None
            slot = self.acquire(ref)
            self.release(ref)
            return slot

    def unload(self, name_or_key: str) -> None:
        """Refuse new requests for every version of a name (or one key) at once; slots and
        CPU memory are freed when their last running request releases them."""
        with self._lock:
            self._run(self.pool.unload(name_or_key), {})

    def slot_of(self, ref: AdapterRef) -> int | None:
        with self._lock:
            return self.pool.slot_of(ref.key)

    def stats(self) -> PoolStats:
        with self._lock:
            return self.pool.stats()

    @property
    def cpu_nbytes(self) -> int:
        """Bytes of packed adapter weights held in the CPU cache."""
        with self._lock:
            return sum(w.nbytes for w in self._cpu.values())

    def _preload_if_on_disk(self, key: str) -> dict[str, AdapterWeights]:
        """Read weights the pool would load from disk *before* it commits to that."""
        if key not in self.pool or key in self._cpu or self.pool.slot_of(key) is not None:
            return {}
        if not self.pool.can_admit(key):
            return {}
        return {key: load_adapter_weights(self._manifests[key], self.base, self.dtype)}

    def _run(self, actions: list[PoolAction], preloaded: dict[str, AdapterWeights]) -> None:
        evicted: set[int] = set()
        for a in actions:
            if a.kind == LOAD_CPU:
                self._cpu[a.key] = preloaded[a.key]
            elif a.kind == DROP_CPU:
                del self._cpu[a.key]
            elif a.kind == EVICT_SLOT:
                evicted.add(a.slot)
            elif a.kind == LOAD_SLOT:
                weights = self._cpu[a.key] if a.source == "cpu" else preloaded[a.key]
                self._cpu[a.key] = weights
                self.buffers.write(a.slot, weights)
                evicted.discard(a.slot)
            elif a.kind == FORGET:
                del self._manifests[a.key]
        # A slot left empty is zeroed so a stale token->slot mapping cannot reuse old weights.
        for slot in evicted:
            self.buffers.clear(slot)
