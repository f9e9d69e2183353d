"""Partial last blocks: a request's last, not yet full block, kept in the prefix cache
when it ends, so the request that continues it (a conversation's next turn resends every
token this one computed) resumes mid-block instead of recomputing up to ``block_size - 1``
tokens. Pure Python.

    finished request:  [ b0 ][ b1 ][ b2 | 5 rows ]       b2 kept under hash(b1, its 5 tokens)
    next turn:         [ b0 ][ b1 ][ b2 | 5 rows + its own rows ... ]

A partial block is indexed, in each layer group's pool, under the hash its rows would have
as a block of that many tokens (``hash_block(parent, rows)``; a list of fewer than
``block_size`` tokens never hashes like a full block). It waits in the free list as any
cached block does and is evicted the same way, without KV events (routers and lower tiers
see full blocks only). A request that hits it takes it whole and writes its next rows into
it, so the block leaves the index at once: another request with the same prefix recomputes
those rows (two requests rarely continue one tail).

Only for pages whose rows are each one token's (full attention, MLA): window and compressed
groups keep block-granular prefixes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from openinfer.kv.block_hash import ROOT_HASH, BlockHash, hash_block
from openinfer.kv.block_pool import GroupPool


class PartialBlocks:
    def __init__(self, pools: list[GroupPool], block_size: int) -> None:
        self.pools = pools
        self.block_size = block_size
        self._entries: dict[BlockHash, tuple[BlockHash, int]] = {}
        """Partial hash -> (parent hash, rows)."""
        self._rows: dict[BlockHash, Counter[int]] = {}
        """Parent hash -> how many partial blocks of each row count follow it."""
        self._dropping: set[BlockHash] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def _parent(self, block_hashes: Sequence[BlockHash], index: int,
                cache_salt: str | None) -> tuple[BlockHash, tuple]:
        """The chain's parent of block ``index`` and the extra keys it is hashed with."""
        if index:
            return block_hashes[index - 1], ()
        return ROOT_HASH, () if cache_salt is None else (cache_salt,)

    def keep(self, tables: list[list[int]], block_hashes: Sequence[BlockHash],
             token_ids: Sequence[int], num_computed_tokens: int, cache_salt: str | None) -> None:
        """Index the last block of a request about to be freed if it holds computed rows
        short of a full block (the request still holds it)."""
        # (Rows past the tokens are a stop's: verified drafts after it were dropped.)
        index, rows = divmod(min(num_computed_tokens, len(token_ids)), self.block_size)
        if not rows or len(block_hashes) < index or any(len(t) <= index for t in tables):
            return
        parent, extra = self._parent(block_hashes, index, cache_salt)
        start = index * self.block_size
        partial = hash_block(parent, token_ids[start:start + rows], extra)
        if partial in self._entries:
            return
        for pool, table in zip(self.pools, tables):
            pool.cache(table[index], partial)
        self._entries[partial] = (parent, rows)
        self._rows.setdefault(parent, Counter())[rows] += 1

    def find(self, block_hashes: Sequence[BlockHash], num_full: int, token_ids: Sequence[int],
             num_tokens: int, cache_salt: str | None) -> tuple[list[int], int] | None:
        """The kept partial block that continues a hit of ``num_full`` full blocks with the
        most rows (short of the request's last token, which is always computed): its block
        in each group, and its rows."""
        parent, extra = self._parent(block_hashes, num_full, cache_salt)
        counts = self._rows.get(parent)
        if not counts:
            return None
        start = num_full * self.block_size
        most = min(self.block_size - 1, num_tokens - 1 - start, len(token_ids) - start)
        for rows in sorted(counts, reverse=True):
            if rows <= most:
                partial = hash_block(parent, token_ids[start:start + rows], extra)
                if partial in self._entries:
                    return [pool.lookup(partial) for pool in self.pools], rows
        return None

    def take(self, blocks: list[int]) -> None:
        """A request took these blocks (one per group, referenced by it now): they leave the
        index, since it writes past their rows."""
        self.pools[0].pool.uncache(blocks[0])  # evicted(): the other groups' follow

    def evicted(self, block_hash: BlockHash) -> bool:
        """The pool dropped ``block_hash`` from one group's index (eviction, or ``take``):
        whether it was a partial block. Its pages in the other groups are dropped with it
        (useless alone)."""
        if block_hash in self._dropping:
            return True
        entry = self._entries.pop(block_hash, None)
        if entry is None:
            return False
        parent, rows = entry
        counts = self._rows[parent]
        counts[rows] -= 1
        if not counts[rows]:
            del counts[rows]
            if not counts:
                del self._rows[parent]
        self._dropping.add(block_hash)
        for pool in self.pools:
            block = pool.lookup(block_hash)
            if block is not None:
                pool.pool.uncache(block)
        self._dropping.discard(block_hash)
        return True

    def clear(self) -> None:
        """The pool's index was reset."""
        self._entries.clear()
        self._rows.clear()
