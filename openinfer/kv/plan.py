"""What the KV cache's bytes must do in one step: decided by the scheduler (pure Python),
carried in ``SchedulerOutput.kv``, done by the worker that owns the tensors.

    stores   device -> host slot (write-through of newly cached blocks), then queued
             for the file store when there is one
    loads    host slot -> device (L2 hits), after the stores, before the forward pass
    reads    file store or prefill instance -> reserved host slots, asynchronously; each
             finishes with a ``finish_load`` on the scheduler a later step
    releases prefill instances whose blocks this side turned out not to need
    pins     (hash, until): the file store keeps these blocks' files until then
"""

from __future__ import annotations

from dataclasses import dataclass, field

from openinfer.kv.block_hash import BlockHash
from openinfer.kv.remote import KVTransferParams


@dataclass(frozen=True)
class BlockCopy:
    """One cached block between the device and a host slot."""
    block_hash: BlockHash
    blocks: tuple[int, ...]
    """The block's device id in each layer group."""
    slot: int


@dataclass
class BlockLoad:
    """Blocks to read into reserved host slots for a request, from the file store or, with
    ``source``, from a prefill instance (its kv_transfer_params)."""
    request_id: str
    blocks: list[tuple[BlockHash, int]]
    """(hash, host slot) in prompt order."""
    source: KVTransferParams | None = None


@dataclass
class KVPlan:
    stores: list[BlockCopy] = field(default_factory=list)
    loads: list[BlockCopy] = field(default_factory=list)
    reads: list[BlockLoad] = field(default_factory=list)
    releases: list[KVTransferParams] = field(default_factory=list)
    pins: list[tuple[BlockHash, float]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads or self.reads or self.releases or self.pins)
