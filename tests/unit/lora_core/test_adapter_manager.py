import shutil
from pathlib import Path

import pytest
import torch

from lora_core.errors import (
    AdapterDraining,
    AdapterIncompatible,
    AdapterLoadFailed,
    AdapterNotFound,
)
from lora_core.identity import AdapterRef
from lora_core.manager import AdapterManager
from lora_core.slot_buffers import SlotBuffers
from lora_core.validate import content_hash, validate_adapter_dir
from lora_core.weights import load_adapter_weights


def _ref(path: Path, name: str, version: int = 1) -> AdapterRef:
    return AdapterRef(name, version, content_hash(path), str(path), rank=4)


@pytest.fixture
def manager(base) -> AdapterManager:
    buffers = SlotBuffers(base, max_loras=2, max_rank=8, dtype=torch.float32, device="cpu")
    mgr = AdapterManager(base, buffers, max_cpu_loras=2, max_rank=8, dtype=torch.float32)
    yield mgr
    mgr.close()


def _all_zero(buffers: SlotBuffers, slot: int) -> bool:
    return all(
        not t[slot].any()
        for layer in range(buffers.base.num_layers)
        for group in ("qkv", "o", "gate_up", "down")
        for t in buffers.a(layer, group) + buffers.b(layer, group)
    )


def test_acquire_copies_packed_weights_into_the_slot(manager, make_adapter, base) -> None:
    path = make_adapter("a", r=4, target_modules=["q_proj", "down_proj"])
    ref = _ref(path, "a")
    manifest = manager.register(ref)
    assert manifest.content_hash == ref.content_hash
    assert manager.stats().cpu_keys == (ref.key,) and manager.slot_of(ref) is None
    assert manager.can_admit(ref)
    slot = manager.acquire(ref)
    assert slot == 0 and manager.slot_of(ref) == 0
    want = load_adapter_weights(
        validate_adapter_dir(path, max_rank=8, base=base), base, torch.float32
    )
    q = want.slices(1, "qkv")[0]
    assert torch.equal(manager.buffers.a(1, "qkv")[0][0, :4], q.a)
    assert torch.equal(manager.buffers.b(1, "qkv")[0][0, :, :4], q.b)
    assert torch.equal(manager.buffers.b(1, "down")[0][0, :, :4], want.slices(1, "down")[0].b)
    assert manager.buffers.slot_ranks.tolist() == [4, 0]
    assert manager.cpu_nbytes == want.nbytes
    manager.release(ref)


def test_register_errors_leave_everything_untouched(manager, make_adapter) -> None:
    too_big = make_adapter("big", r=16)
    with pytest.raises(AdapterIncompatible, match="^r: "):
        manager.register(_ref(too_big, "big"))
    good = make_adapter("good")
    stale = AdapterRef("good", 1, "0" * 64, str(good), 4)
    with pytest.raises(AdapterLoadFailed, match="is not the registered"):
        manager.register(stale)
    s = manager.stats()
    assert s.cpu_keys == () and s.slots == (None, None) and manager.cpu_nbytes == 0
    assert _all_zero(manager.buffers, 0) and _all_zero(manager.buffers, 1)
    with pytest.raises(AdapterNotFound):
        manager.can_admit(stale)


def test_cpu_eviction_then_reload_from_disk(manager, make_adapter) -> None:
    refs = [_ref(make_adapter(n, lora_seed=i), n) for i, n in enumerate("abc")]
    for ref in refs:
        manager.register(ref)
    assert manager.stats().cpu_keys == (refs[1].key, refs[2].key)
    slot = manager.acquire(refs[0])  # a was dropped from CPU: read again from disk
    s = manager.stats()
    assert (s.loads_from_disk, s.loads_from_cpu) == (1, 0)
    assert s.cpu_keys == (refs[2].key, refs[0].key) and s.slots[slot] == refs[0].key
    manager.release(refs[0])


def test_disk_reload_failure_changes_nothing(manager, make_adapter) -> None:
    refs = [_ref(make_adapter(n, lora_seed=i), n) for i, n in enumerate("abc")]
    for ref in refs:
        manager.register(ref)
    shutil.rmtree(refs[0].path)
    before = manager.stats()
    with pytest.raises(AdapterLoadFailed):
        manager.acquire(refs[0])
    assert manager.stats() == before
    assert manager.acquire(refs[1]) == 0


def test_waiting_when_slots_busy_and_pin(manager, make_adapter) -> None:
    a, b, c = (_ref(make_adapter(n, lora_seed=i), n) for i, n in enumerate("abc"))
    for ref in (a, b, c):
        manager.register(ref)
    manager.acquire(a)
    manager.acquire(b)
    assert not manager.can_admit(c)
    manager.release(b)
    assert manager.can_admit(c)
    assert manager.pin(c) == 1
    assert manager.stats().pinned == (c.key,)
    manager.release(a)
    manager.unpin(c)
    assert manager.stats().pinned == ()


def test_unload_drains_and_zeroes_the_slot(manager, make_adapter) -> None:
    a = _ref(make_adapter("a"), "a")
    a2 = _ref(make_adapter("a2", lora_seed=5), "a", version=2)
    manager.register(a)
    manager.register(a2)
    slot = manager.acquire(a)
    manager.unload("a")
    with pytest.raises(AdapterDraining):
        manager.can_admit(a)
    with pytest.raises(AdapterDraining):
        manager.acquire(a)
    assert manager.stats().cpu_keys == (a.key,)  # a2 (idle) is gone already
    assert not _all_zero(manager.buffers, slot)
    manager.release(a)
    assert manager.stats().cpu_keys == () and manager.stats().slots == (None, None)
    assert _all_zero(manager.buffers, slot) and manager.buffers.slot_ranks.tolist() == [0, 0]
    manager.register(a)  # registering again after the drain works
    assert manager.acquire(a) == 0


def test_background_register_and_prefetch(manager, make_adapter) -> None:
    a, b, c = (_ref(make_adapter(n, lora_seed=i), n) for i, n in enumerate("abc"))
    futures = [manager.register_async(ref) for ref in (a, b, c)]
    assert [f.result(timeout=60).content_hash for f in futures] == [
        a.content_hash,
        b.content_hash,
        c.content_hash,
    ]
    assert manager.stats().cpu_keys == (b.key, c.key)
    manager.prefetch(a).result(timeout=60)  # drops b (LRU), reads a back
    assert manager.stats().cpu_keys == (c.key, a.key)
    manager.acquire(a)
    s = manager.stats()
    assert (s.loads_from_cpu, s.loads_from_disk, s.cpu_loads) == (1, 0, 4)
    manager.prefetch(a).result(timeout=60)  # already cached: no-op
    assert manager.stats().cpu_loads == 4
    bad = make_adapter("bad", r=16)
    with pytest.raises(AdapterIncompatible):
        manager.register_async(_ref(bad, "bad")).result(timeout=60)
    manager.unload("b")
    manager.prefetch(b).result(timeout=60)  # unknown now: no-op
    assert manager.stats().cpu_keys == (c.key, a.key)


def test_prefetch_to_gpu_and_unpin_by_name(manager, make_adapter) -> None:
    a, b, c = (_ref(make_adapter(n, lora_seed=i), n) for i, n in enumerate("abc"))
    for ref in (a, b, c):
        manager.register(ref)
    assert manager.prefetch_to_gpu(a) == 0
    assert manager.pool.refcount(a.key) == 0 and manager.slot_of(a) == 0
    manager.acquire(b)
    manager.acquire(b)
    assert manager.prefetch_to_gpu(c) == 0  # a was idle: evicted
    manager.acquire(c)
    assert manager.prefetch_to_gpu(a) is None  # both slots hold running requests
    manager.release(c)
    manager.pin(c)
    manager.unpin("c")
    s = manager.stats()
    assert s.pinned == () and (s.gpu, s.cpu, s.loads) == (s.gpu_keys, s.cpu_keys, s.slot_loads)
    assert s.gpu == (c.key, b.key) and s.loads == 3
