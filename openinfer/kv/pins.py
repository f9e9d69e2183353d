"""Pinned prefixes (prompt caching's breakpoints): which blocks must stay cached until when,
and whose they are. Pure Python.

A request's pin keeps its prompt's first blocks for a TTL from when they are computed or hit
(Anthropic's ``cache_control``, OpenAI's ``prompt_cache_retention``); pinning them again
refreshes the TTL. What a pin holds, tier by tier (kv_manager.py): the host tier never evicts
a pinned block, the file store's collector never deletes one (its file's mtime is set to the
expiry, kv/plan.py), and the device prefers to evict others first.

Pins are capped in bytes, per owner (an API key's tenant) and in all: a pin that would take
its owner or everyone past a cap is refused whole (the request is still served). A block
pinned by two owners counts against both, once in all; so one tenant can neither pin the
whole cache nor, by pinning, evict another's pins.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from openinfer.kv.block_hash import BlockHash
from openinfer.kv.block_pool import GroupPool


@dataclass
class PinLimits:
    max_blocks: int
    """Blocks pinned in all."""
    max_blocks_per_owner: int


@dataclass
class _Pin:
    owners: dict[str | None, float] = field(default_factory=dict)
    """Owner -> when its pin ends."""

    @property
    def expiry(self) -> float:
        return max(self.owners.values())


class PinTable:
    """The pins, and the device pool's view of them: a pinned block's page in each group is
    flagged in the pool (reused last) while it is cached."""

    def __init__(self, limits: PinLimits, pools: list[GroupPool] | None = None) -> None:
        self.limits = limits
        self.pools = pools or []
        self._pins: dict[BlockHash, _Pin] = {}
        self._per_owner: Counter[str | None] = Counter()
        self._ends: list[tuple[float, BlockHash, str | None]] = []
        """(end, hash, owner) of every pin taken or refreshed (a heap; stale entries skipped)."""
        self.num_refused = 0

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._pins

    def __len__(self) -> int:
        return len(self._pins)

    def expiry(self, block_hash: BlockHash) -> float | None:
        pin = self._pins.get(block_hash)
        return None if pin is None else pin.expiry

    def num_pinned_by(self, owner: str | None) -> int:
        return self._per_owner[owner]

    def pin(self, hashes: list[BlockHash], ttl_s: float, owner: str | None, now: float) -> bool:
        """Pin (or refresh) these blocks for ``owner`` until ``now + ttl_s``; False, changing
        nothing, when that would take the owner or everyone past a cap."""
        new = [h for h in hashes if h not in self._pins]
        new_for_owner = [h for h in hashes if owner not in self._pins.get(h, _Pin()).owners]
        if (len(self._pins) + len(new) > self.limits.max_blocks
                or owner is not None  # (no API keys: one tenant, capped in all only)
                and self._per_owner[owner] + len(new_for_owner) > self.limits.max_blocks_per_owner):
            self.num_refused += 1
            return False
        end = now + ttl_s
        for h in hashes:
            pin = self._pins.setdefault(h, _Pin())
            if pin.owners.get(owner, 0.0) < end:
                pin.owners[owner] = end
                heapq.heappush(self._ends, (end, h, owner))
        self._per_owner[owner] += len(new_for_owner)
        return True

    def pin_cached(self, hashes: list[BlockHash], cached: Callable[[BlockHash], bool],
                   ttl_s: float, owner: str | None, now: float) -> list[tuple[BlockHash, float]]:
        """Pin the leading blocks of ``hashes`` that are ``cached`` (in some tier); (hash,
        until) of each pinned, none when a cap refuses."""
        n = next((i for i, h in enumerate(hashes) if not cached(h)), len(hashes))
        if not n or not self.pin(hashes[:n], ttl_s, owner, now):
            return []
        for h in hashes[:n]:
            self._flag(h, True)
        return [(h, self._pins[h].expiry) for h in hashes[:n]]

    def cached_again(self, block_hash: BlockHash) -> None:
        """A pinned block the device had let go was computed or loaded again."""
        if block_hash in self._pins:
            self._flag(block_hash, True)

    def _flag(self, block_hash: BlockHash, pinned: bool) -> None:
        for pool in self.pools:
            block = pool.lookup(block_hash)
            if block is not None:
                pool.pool.set_pinned(block, pinned)

    def expire(self, now: float) -> list[BlockHash]:
        """Drop the pins that ended by ``now``; the blocks no owner pins any more."""
        unpinned = []
        while self._ends and self._ends[0][0] <= now:
            end, h, owner = heapq.heappop(self._ends)
            pin = self._pins.get(h)
            if pin is None or pin.owners.get(owner) != end:
                continue  # refreshed since (a later entry holds it), or cleared
            del pin.owners[owner]
            self._per_owner[owner] -= 1
            if not pin.owners:
                del self._pins[h]
                self._flag(h, False)
                unpinned.append(h)
        return unpinned

    def clear(self) -> None:
        self._pins.clear()
        self._per_owner.clear()
        self._ends.clear()
