"""KV block allocation with prefix caching (pure Python; no tensors).

A full block is identified by a chain hash over (parent block hash, adapter identity,
the block's tokens). Two sequences share a block only when their adapter identity
AND every token up to the end of that block are equal, so one prompt under two
adapters never shares KV.

Example (block_size 2, adapter key "a@1:ff"): tokens [5, 6, 7, 8, 9] give full-block
hashes h0 = H(None, "a@1:ff", (5, 6)), h1 = H(h0, "a@1:ff", (7, 8)); token 9 sits in a
partial block that is never shared.

Blocks whose last user left but that carry a hash stay cached (LRU) until a fresh
block is needed; a later request with the same prefix revives them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence as Seq


def block_hash(parent: int | None, adapter_key: str, tokens: Seq[int]) -> int:
    """128 bits of sha256 over (parent hash, adapter identity, the block's token ids).

    Not Python's hash(): a tuple of ints hashes the same in every process, and its
    mixing is invertible, so one tenant can craft token blocks whose hash equals another
    tenant's prompt block and read or poison its cached KV (vLLM's CVE-2025-25183).
    """
    key = adapter_key.encode()
    digest = hashlib.sha256()
    # fixed-width parent, length-prefixed key, tokens last: the encoding is injective
    digest.update(bytes(17) if parent is None else parent.to_bytes(16, "little") + b"\x01")
    digest.update(len(key).to_bytes(4, "little") + key)
    digest.update(array("q", tokens).tobytes())
    return int.from_bytes(digest.digest()[:16], "little")


class BlockManager:
    """num_blocks blocks of block_size tokens; ref-counted; optional prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._hash_of: dict[int, int] = {}
        self._cached: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.prefix_hit_tokens = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def blocks_needed(self, num_tokens: int, have: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise RuntimeError("allocate beyond free blocks")  # callers check num_free first
        out = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._cached[self._hash_of.pop(block)]
            self._ref[block] = 1
            out.append(block)
        return out

    def take_cached(self, h: int) -> int | None:
        """A reference on the cached block whose hash is h, None when none is (or prefix
        caching is off). A block with no other user comes back from the LRU list."""
        block = self._cached.get(h) if self.prefix_caching else None
        if block is None:
            return None
        if self._ref[block] == 0:
            del self._evictable[block]
        self._ref[block] += 1
        self.prefix_hit_tokens += self.block_size
        return block

    def publish(self, block: int, h: int) -> None:
        """Make a just-filled block findable by its hash (first writer wins)."""
        if self.prefix_caching and h not in self._cached and block not in self._hash_of:
            self._cached[h] = block
            self._hash_of[block] = h

    def free(self, blocks: Seq[int]) -> None:
        for block in reversed(blocks):
            self._ref[block] -= 1
            assert self._ref[block] >= 0, "block freed twice"
            if self._ref[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._ref[block]
