"""What enters and leaves a replica's prefix cache, tier by tier: the KV manager records these,
the publisher (kv/events.py) sends them in vLLM's schema."""

from __future__ import annotations

from dataclasses import dataclass

from openinfer.kv.block_hash import BlockHash


@dataclass(frozen=True)
class BlockStored:
    """A full block became cached in a tier (vLLM's KV-event of the same name)."""
    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    tier: str = "L1"


@dataclass(frozen=True)
class BlockRemoved:
    block_hash: BlockHash
    tier: str = "L1"


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
