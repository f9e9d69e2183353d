"""A fixed pool of KV block ids with reference counts and a prefix cache. Pure Python.

A block is *free* when no request holds it (refcount 0). A free block may still be
*cached*: it keeps the content hash of the full block it holds, so a later request
with the same prefix takes it back by reference instead of recomputing it. Free
blocks wait in eviction order (first = reused next):

    [ never-cached blocks ... | cached blocks, least recently freed first ]

Uncached blocks go to the front when freed, so reusing them never pushes a cached
prefix out; cached blocks go to the back, a request's tail before its head, so a
finished request loses its private tail before the head it shares with others.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from openinfer.kv.block_hash import BlockHash


class BlockPool:
    """Hands out block ids ``0 .. num_blocks-1``."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_count = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._block_of: dict[BlockHash, int] = {}
        self.on_evict: Callable[[BlockHash], None] | None = None
        """Told the hash of every cached block that is evicted (KV events)."""

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free, cached or not)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def ref_count(self, block: int) -> int:
        return self._ref_count[block]

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    # ---- plain allocation ------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"BlockPool: asked for {n} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref_count[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block, in the order given (pass a table tail first)."""
        for b in blocks:
            if self._ref_count[b] <= 0:
                raise RuntimeError(f"BlockPool: block {b} freed more often than allocated")
            self._ref_count[b] -= 1
            if self._ref_count[b] == 0:
                self._free[b] = None
                if self._hash_of[b] is None:
                    self._free.move_to_end(b, last=False)

    # ---- prefix cache ----------------------------------------------------------------

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding this content, if cached."""
        return self._block_of.get(block_hash)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._block_of

    def touch(self, blocks: list[int]) -> None:
        """Take a reference to cached blocks (a prefix hit), reviving free ones."""
        for b in blocks:
            if self._ref_count[b] == 0:
                del self._free[b]
            self._ref_count[b] += 1

    def cache(self, block: int, block_hash: BlockHash) -> bool:
        """Mark a held, now full block as holding ``block_hash``; False when another block
        already holds that content (this one then stays private)."""
        if not self.enable_caching or block_hash in self._block_of:
            return False
        assert self._ref_count[block] > 0 and self._hash_of[block] is None
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        return True

    def reset_cache(self) -> int:
        """Forget every cached hash (blocks in use keep their data but become private)."""
        count = len(self._block_of)
        self._block_of.clear()
        self._hash_of = [None] * self.num_blocks
        return count

    def _evict(self, block: int) -> None:
        block_hash = self._hash_of[block]
        if block_hash is None:
            return
        self._hash_of[block] = None
        del self._block_of[block_hash]
        if self.on_evict is not None:
            self.on_evict(block_hash)

    def check_integrity(self, held: dict[int, int] | None = None) -> None:
        """Assert free list, refcounts and cache index agree (and match ``held``)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b, count in enumerate(self._ref_count):
            assert count >= 0, f"block {b} has a negative refcount"
            assert (count == 0) == (b in free), f"block {b}: refcount {count} vs free list"
            if held is not None:
                assert held.get(b, 0) == count, f"block {b}: refcount {count}, held {held.get(b, 0)}"
        for block_hash, b in self._block_of.items():
            assert self._hash_of[b] == block_hash, f"block {b}: cache index disagrees"
        assert sum(h is not None for h in self._hash_of) == len(self._block_of), (
            "a block has a hash the index does not know")
