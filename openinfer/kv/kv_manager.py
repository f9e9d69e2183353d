"""Per-request block tables over per-layer-group block pools. Pure Python: no tensors.

Every layer group has its own pool of ``num_blocks`` blocks (its own cache tensor on
the device); a request holds one block table per group. A request's tables grow as
its tokens are scheduled:

    tokens:  | computed (cached KV)  | scheduled this step | not yet scheduled |
    blocks:  [ b0 ][ b1 ][ b2 ][ b3 ][ b4 ]
              '--- held: blocks_for(computed + scheduled) ---'
"""

from __future__ import annotations

from openinfer.kv.block_pool import BlockPool
from openinfer.kv.spec import LayerGroup


class KVCacheManager:
    def __init__(self, groups: list[LayerGroup], num_blocks: int) -> None:
        if not groups:
            raise ValueError("the model has no KV cache layers")
        sizes = {g.spec.block_size for g in groups}
        if len(sizes) != 1:
            raise ValueError(f"all layer groups must share one block size, got {sorted(sizes)}")
        self.groups = groups
        self.block_size = sizes.pop()
        self.num_blocks = num_blocks
        self.pools = [BlockPool(num_blocks) for _ in groups]
        self._tables: dict[str, list[list[int]]] = {}

    @property
    def usage(self) -> float:
        return max(pool.usage for pool in self.pools)

    def block_table(self, request_id: str) -> list[list[int]]:
        """The request's block ids, one list per layer group."""
        return self._tables.get(request_id) or [[] for _ in self.groups]

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[list[int]] | None:
        """Grow the request's tables to cover ``num_tokens`` tokens.

        Returns the newly added block ids per group, or None (allocating nothing)
        when some group's pool lacks room.
        """
        tables = self.block_table(request_id)
        wanted = [max(0, g.spec.blocks_for(num_tokens) - len(t))
                  for g, t in zip(self.groups, tables)]
        if any(n > pool.num_free for n, pool in zip(wanted, self.pools)):
            return None
        new_blocks = [pool.allocate(n) for n, pool in zip(wanted, self.pools)]
        for table, blocks in zip(tables, new_blocks):
            table.extend(blocks)
        self._tables[request_id] = tables
        return new_blocks

    def free(self, request_id: str) -> None:
        """Release all of the request's blocks (last block first)."""
        tables = self._tables.pop(request_id, None)
        if tables is None:
            return
        for pool, table in zip(self.pools, tables):
            pool.free(table[::-1])

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
