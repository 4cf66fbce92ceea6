import pytest

from replica.block_manager import BlockManager, block_hash


def _chain(bs: int, key: str, tokens: list[int]) -> list[int]:
    """The hashes of tokens' full blocks."""
    hashes: list[int] = []
    for i in range(len(tokens) // bs):
        parent = hashes[-1] if hashes else None
        hashes.append(block_hash(parent, key, tokens[i * bs : (i + 1) * bs]))
    return hashes


def _fill(bm: BlockManager, key: str, tokens: list[int]) -> list[int]:
    """Allocate blocks for tokens and publish the full ones (as the scheduler does)."""
    blocks = bm.allocate(bm.blocks_needed(len(tokens), 0))
    for block, h in zip(blocks, _chain(bm.block_size, key, tokens), strict=False):
        bm.publish(block, h)
    return blocks


def _take(bm: BlockManager, key: str, tokens: list[int], max_blocks: int) -> list[int]:
    """The cached blocks of tokens' longest cached prefix (at most max_blocks)."""
    taken = []
    for h in _chain(bm.block_size, key, tokens)[:max_blocks]:
        block = bm.take_cached(h)
        if block is None:
            break
        taken.append(block)
    return taken


def test_same_adapter_shares_blocks_other_adapter_does_not():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    prompt = list(range(10))
    first = _fill(bm, "a@1:x", prompt)
    hit = _take(bm, "a@1:x", prompt, max_blocks=2)
    assert hit == first[:2] and bm.prefix_hit_tokens == 8
    assert all(bm.ref_count(b) == 2 for b in hit)
    assert _take(bm, "b@1:y", prompt, max_blocks=2) == []
    # A new version of the same name is a new identity too.
    assert _take(bm, "a@2:z", prompt, max_blocks=2) == []
    assert bm.prefix_hit_tokens == 8


def test_prefix_caching_off_never_shares():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    prompt = list(range(12))
    _fill(bm, "", prompt)
    assert _take(bm, "", prompt, max_blocks=3) == [] and bm.prefix_hit_tokens == 0


def test_freed_cached_blocks_are_revived_then_evicted_lru():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    a = _fill(bm, "", [1, 2, 3, 4])
    bm.free(a)
    assert bm.num_free == 4
    hit = _take(bm, "", [1, 2, 3, 4, 5], max_blocks=2)
    assert hit == a
    bm.free(hit)
    # Freed tail-first, so the tail block is the LRU one and goes first: the prefix survives.
    fresh = bm.allocate(3)
    assert len(set(fresh)) == 3 and a[1] in fresh and a[0] not in fresh
    assert _take(bm, "", [1, 2, 3, 4], max_blocks=2) == [a[0]]


def test_allocate_beyond_capacity_is_refused():
    bm = BlockManager(2, 4, enable_prefix_caching=False)
    bm.allocate(2)
    with pytest.raises(RuntimeError):
        bm.allocate(1)


def test_block_hash_is_not_pythons_collidable_tuple_hash():
    """Two blocks whose Python tuple hashes are equal (crafted by inverting the tuple
    hash's mixing, as an attacker would) must get different prefix-cache keys."""
    a, b = (0, 5), (3, -690149475412880183)
    assert hash((None, "t@1:ab", a)) == hash((None, "t@1:ab", b))
    assert block_hash(None, "t@1:ab", a) != block_hash(None, "t@1:ab", b)
    h = block_hash(None, "t@1:ab", a)
    assert block_hash(h, "t@1:ab", a) != block_hash(h, "t@1:ac", a) != h
    assert block_hash(None, "", [1, 2]) == block_hash(None, "", (1, 2))  # any sequence type
