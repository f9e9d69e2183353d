"""A fixed pool of KV block ids with reference counts. Pure Python: no tensors."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out block ids ``0 .. num_blocks-1``; a block is free when its refcount is 0.

    Reference counts let several holders share a block (prefix caching); a plain
    request holds each of its blocks once.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_count = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"BlockPool: asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_count[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks that reach 0 return to the free list."""
        for b in blocks:
            if self._ref_count[b] <= 0:
                raise RuntimeError(f"BlockPool: block {b} freed more often than allocated")
            self._ref_count[b] -= 1
            if self._ref_count[b] == 0:
                self._free.append(b)

    def check_integrity(self, held: dict[int, int] | None = None) -> None:
        """Assert the free list and refcounts agree (and match ``held``: block -> holders)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b, count in enumerate(self._ref_count):
            assert count >= 0, f"block {b} has a negative refcount"
            assert (count == 0) == (b in free), f"block {b}: refcount {count} vs free list"
            if held is not None:
                assert held.get(b, 0) == count, f"block {b}: refcount {count}, held {held.get(b, 0)}"
