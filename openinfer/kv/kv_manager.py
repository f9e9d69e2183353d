"""Per-request block tables over per-layer-group block pools, with prefix caching.
Pure Python: no tensors.

Every layer group has its own pool of ``num_blocks`` blocks (its own cache tensor on
the device); a request holds one block table per group. A request's tables grow as
its tokens are scheduled:

    tokens:  | cached prefix | computed   | scheduled this step | not yet scheduled |
    blocks:  [ b0 ][ b1 ][ b2 ][ b3 ][ b4 ]
              '- hit -'  '--- held: blocks_for(computed + scheduled) ---'

Once a block is full and computed it is *cached* under its chained content hash
(block_hash.py), so any later request with the same prefix takes it by reference.
"""

from __future__ import annotations

from dataclasses import dataclass

from openinfer.kv.block_hash import BlockHash
from openinfer.kv.block_pool import BlockPool
from openinfer.kv.spec import LayerGroup


@dataclass(frozen=True)
class BlockStored:
    """A full block became cached (vLLM's KV-event of the same name)."""
    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlockRemoved:
    block_hash: BlockHash


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVCacheManager:
    def __init__(self, groups: list[LayerGroup], num_blocks: int,
                 enable_caching: bool = True) -> None:
        if not groups:
            raise ValueError("the model has no KV cache layers")
        sizes = {g.spec.block_size for g in groups}
        if len(sizes) != 1:
            raise ValueError(f"all layer groups must share one block size, got {sorted(sizes)}")
        self.groups = groups
        self.block_size = sizes.pop()
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.pools = [BlockPool(num_blocks, enable_caching) for _ in groups]
        self._tables: dict[str, list[list[int]]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        """Per request: how many of its leading blocks are already in the cache index."""
        self.events: list[KVEvent] = []
        """What entered and left the cache since the caller last drained this list."""
        self.pools[0].on_evict = lambda h: self.events.append(BlockRemoved(h))
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def usage(self) -> float:
        return max(pool.usage for pool in self.pools)

    def block_table(self, request_id: str) -> list[list[int]]:
        """The request's block ids, one list per layer group."""
        return self._tables.get(request_id) or [[] for _ in self.groups]

    # ---- prefix hits -----------------------------------------------------------------

    def find_cached_prefix(self, block_hashes: list[BlockHash],
                           num_tokens: int) -> tuple[list[list[int]], int]:
        """The longest cached prefix of a request: (block ids per group, tokens covered).

        At most ``num_tokens - 1`` tokens hit (whole blocks), so the last token is always
        computed and yields the logits to sample from."""
        if not self.enable_caching:
            return [[] for _ in self.groups], 0
        hits: list[list[int]] = [[] for _ in self.groups]
        for block_hash in block_hashes[:(num_tokens - 1) // self.block_size]:
            found = [pool.lookup(block_hash) for pool in self.pools]
            if any(b is None for b in found):
                break
            for table, b in zip(hits, found):
                table.append(b)
        return hits, len(hits[0]) * self.block_size

    def record_prefix_query(self, num_tokens: int, num_hit: int) -> None:
        """Count one request's lookup in the hit-rate counters (once per request)."""
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit

    # ---- allocation ------------------------------------------------------------------

    def allocate_slots(self, request_id: str, num_tokens: int,
                       cached: list[list[int]] | None = None) -> list[list[int]] | None:
        """Grow the request's tables to cover ``num_tokens`` tokens, starting with the
        ``cached`` prefix blocks (a new request's hit) when given.

        Returns the block ids added per group (hits first), or None (changing nothing)
        when some group's pool lacks room.
        """
        tables = self.block_table(request_id)
        cached = cached or [[] for _ in self.groups]
        wanted = [max(0, g.spec.blocks_for(num_tokens) - len(t) - len(c))
                  for g, t, c in zip(self.groups, tables, cached)]
        for n, hits, pool in zip(wanted, cached, self.pools):
            reviving = sum(1 for b in hits if pool.ref_count(b) == 0)
            if n + reviving > pool.num_free:
                return None
        added = []
        for table, hits, n, pool in zip(tables, cached, wanted, self.pools):
            pool.touch(hits)
            blocks = hits + pool.allocate(n)
            table.extend(blocks)
            added.append(blocks)
        self._tables[request_id] = tables
        if cached[0]:
            self._num_cached_blocks[request_id] = len(cached[0])
        return added

    def cache_blocks(self, request_id: str, block_hashes: list[BlockHash],
                     token_ids: list[int], num_computed_tokens: int) -> list[BlockHash]:
        """Index the request's blocks that are now full and computed; returns the hashes
        that newly entered the cache."""
        if not self.enable_caching or request_id not in self._tables:
            return []
        done = self._num_cached_blocks.get(request_id, 0)
        full = min(num_computed_tokens // self.block_size, len(block_hashes))
        stored = []
        tables = self._tables[request_id]
        for i in range(done, full):
            new = [pool.cache(table[i], block_hashes[i]) for pool, table in zip(self.pools, tables)]
            if new[0]:
                stored.append(block_hashes[i])
                bs = self.block_size
                self.events.append(BlockStored(
                    block_hashes[i], block_hashes[i - 1] if i else None,
                    tuple(token_ids[i * bs:(i + 1) * bs])))
        self._num_cached_blocks[request_id] = max(done, full)
        return stored

    def free(self, request_id: str) -> None:
        """Release all of the request's blocks, tail first (so the tail is evicted first)."""
        tables = self._tables.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        if tables is None:
            return
        for pool, table in zip(self.pools, tables):
            pool.free(table[::-1])

    def reset_cache(self) -> int:
        """Forget every cached prefix (admin reset); returns how many blocks were cached."""
        count = self.pools[0].num_cached
        for pool in self.pools:
            pool.reset_cache()
        self.events.append(AllBlocksCleared())
        return count

    def check_integrity(self) -> None:
        """Assert every block's refcount equals the number of tables that hold it."""
        for g, pool in enumerate(self.pools):
            held: dict[int, int] = {}
            for tables in self._tables.values():
                for b in tables[g]:
                    held[b] = held.get(b, 0) + 1
            pool.check_integrity(held)

    @property
    def num_requests(self) -> int:
        return len(self._tables)
