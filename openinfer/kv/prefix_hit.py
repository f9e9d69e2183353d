"""A request's cached prefix as the KV manager found it, tier by tier."""

from __future__ import annotations

from dataclasses import dataclass, field

from openinfer.kv.block_hash import BlockHash


@dataclass
class PrefixHit:
    """A request's cached prefix, tier by tier (each continues the one before)."""
    blocks: list[list[int]]
    """L1: device block ids per layer group."""
    host_slots: list[tuple[BlockHash, int]] = field(default_factory=list)
    """L2: (hash, host slot) of the blocks to copy back to the device."""
    store_hashes: list[BlockHash] = field(default_factory=list)
    """L3: blocks in the file store, to read into L2 before the request can start."""
    block_size: int = 16
    num_replayed_tokens: int = 0
    """Tokens the full groups hold beyond the hit, recomputed for the window state."""
    partial_rows: int = 0
    """When nonzero, the last of ``blocks`` is a kept partial block of this many rows."""

    @property
    def num_tokens(self) -> int:
        """Tokens the request can start after now (L1 + L2)."""
        return self.num_l1_tokens + len(self.host_slots) * self.block_size

    @property
    def num_l1_tokens(self) -> int:
        short = self.block_size - self.partial_rows if self.partial_rows else 0
        return len(self.blocks[0]) * self.block_size - short
