"""A fixed pool of KV block ids with reference counts and a prefix cache. Pure Python.

A block is *free* when no request holds it (refcount 0). A free block may still be
*cached*: it keeps the content hash of the full block it holds, so a later request
with the same prefix takes it back by reference instead of recomputing it. Free
blocks wait in eviction order (first = reused next):

    [ never-cached blocks ... | cached blocks, least recently freed first ]

Uncached blocks go to the front when freed, so reusing them never pushes a cached
prefix out; cached blocks go to the back, a request's tail before its head, so a
finished request loses its private tail before the head it shares with others.
Pinned blocks (kv/pins.py) wait apart and are reused only when no other block is free.

One pool serves every layer group of a model (each group's device tensor is a view of
one buffer of ``num_blocks`` pages): a block id belongs to one group at a time, and each
group has its own prefix-cache index (the same content hash names a different page in
each group). ``GroupPool`` is one group's face of the shared pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from openinfer.kv.block_hash import BlockHash


class BlockPool:
    """Hands out block ids ``0 .. num_blocks-1``."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, num_groups: int = 1) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free_pinned: OrderedDict[int, None] = OrderedDict()
        """Free blocks holding pinned content: reused last."""
        self._pinned: set[int] = set()
        self._ref_count = [0] * num_blocks
        self._hash_of: list[tuple[int, BlockHash] | None] = [None] * num_blocks
        """(layer group, content hash) of each cached block."""
        self._block_of: list[dict[BlockHash, int]] = [{} for _ in range(num_groups)]
        """Per layer group: content hash -> block."""
        self.on_evict: Callable[[int, BlockHash], None] | None = None
        """Told (group, hash) of every cached block that is evicted (KV events)."""

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free, cached or not)."""
        return len(self._free) + len(self._free_pinned)

    @property
    def num_cached(self) -> int:
        return sum(len(index) for index in self._block_of)

    def num_cached_in(self, group: int) -> int:
        return len(self._block_of[group])

    def ref_count(self, block: int) -> int:
        return self._ref_count[block]

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    # ---- plain allocation ------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"BlockPool: asked for {n} blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            block, _ = (self._free or self._free_pinned).popitem(last=False)
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
            if self._ref_count[b] == 0 and b in self._pinned:
                self._free_pinned[b] = None
            elif self._ref_count[b] == 0:
                self._free[b] = None
                if self._hash_of[b] is None:
                    self._free.move_to_end(b, last=False)

    # ---- prefix cache ----------------------------------------------------------------

    def lookup(self, block_hash: BlockHash, group: int = 0) -> int | None:
        """The block holding this content for this layer group, if cached."""
        return self._block_of[group].get(block_hash)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._block_of[0]

    def contains(self, block_hash: BlockHash, group: int) -> bool:
        return block_hash in self._block_of[group]

    def touch(self, blocks: list[int]) -> None:
        """Take a reference to cached blocks (a prefix hit), reviving free ones."""
        for b in blocks:
            if self._ref_count[b] == 0:
                del (self._free_pinned if b in self._pinned else self._free)[b]
            self._ref_count[b] += 1

    def cache(self, block: int, block_hash: BlockHash, group: int = 0) -> bool:
        """Mark a held, now full block as holding ``block_hash`` (for ``group``); False when
        another block already holds that content (this one then stays private)."""
        index = self._block_of[group]
        if not self.enable_caching or block_hash in index:
            return False
        assert self._ref_count[block] > 0 and self._hash_of[block] is None
        self._hash_of[block] = (group, block_hash)
        index[block_hash] = block
        return True

    def set_pinned(self, block: int, pinned: bool) -> None:
        """Whether a cached block's content is pinned (a free one is then reused last)."""
        if pinned == (block in self._pinned) or (pinned and self._hash_of[block] is None):
            return
        src, dst = (self._free, self._free_pinned) if pinned else (self._free_pinned, self._free)
        (self._pinned.add if pinned else self._pinned.discard)(block)
        if block in src:
            del src[block]
            dst[block] = None

    def uncache(self, block: int) -> None:
        """Forget the content hash of a held block (told to ``on_evict``): freed, it is
        reused first."""
        self._evict(block)

    def reset_cache(self) -> int:
        """Forget every cached hash (blocks in use keep their data but become private)."""
        count = self.num_cached
        for index in self._block_of:
            index.clear()
        for block in list(self._pinned):
            self.set_pinned(block, False)
        self._hash_of = [None] * self.num_blocks
        return count

    def _evict(self, block: int) -> None:
        key = self._hash_of[block]
        if key is None:
            return
        self.set_pinned(block, False)
        self._hash_of[block] = None
        del self._block_of[key[0]][key[1]]
        if self.on_evict is not None:
            self.on_evict(*key)

    def check_integrity(self, held: dict[int, int] | None = None) -> None:
        """Assert free list, refcounts and cache index agree (and match ``held``)."""
        free = set(self._free) | set(self._free_pinned)
        assert len(free) == self.num_free, "a block is on the free list twice"
        assert set(self._free_pinned) <= self._pinned and not self._pinned & set(self._free)
        for b, count in enumerate(self._ref_count):
            assert count >= 0, f"block {b} has a negative refcount"
            assert (count == 0) == (b in free), f"block {b}: refcount {count} vs free list"
            if held is not None:
                assert held.get(b, 0) == count, f"block {b}: refcount {count}, held {held.get(b, 0)}"
        for group, index in enumerate(self._block_of):
            for block_hash, b in index.items():
                assert self._hash_of[b] == (group, block_hash), f"block {b}: cache index disagrees"
        assert sum(h is not None for h in self._hash_of) == self.num_cached, (
            "a block has a hash the index does not know")


class GroupPool:
    """One layer group's face of a shared ``BlockPool``: allocation and reference counts are
    the pool's; the prefix-cache index is the group's own."""

    def __init__(self, pool: BlockPool, group: int) -> None:
        self.pool = pool
        self.group = group

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.pool.lookup(block_hash, self.group)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return self.pool.contains(block_hash, self.group)

    def cache(self, block: int, block_hash: BlockHash) -> bool:
        return self.pool.cache(block, block_hash, self.group)

    @property
    def num_cached(self) -> int:
        return self.pool.num_cached_in(self.group)

    def allocate(self, n: int) -> list[int]:
        return self.pool.allocate(n)

    def free(self, blocks: list[int]) -> None:
        self.pool.free(blocks)

    def touch(self, blocks: list[int]) -> None:
        self.pool.touch(blocks)

    def ref_count(self, block: int) -> int:
        return self.pool.ref_count(block)
