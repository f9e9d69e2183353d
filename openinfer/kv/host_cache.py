"""Tier L2 bookkeeping: which host-memory slot holds which block. Pure Python.

The host pool (tensor side: kv/transfer.py) has ``num_slots`` slots, each one whole
block of every layer. Blocks are written through: when a device block becomes cached
its bytes are copied to a slot at the start of the next step, so evicting it from the
device later costs nothing and a hit here is one copy back. Slots are reused least
recently used first; a pinned slot (a copy to or from a file in flight) is never reused,
nor a slot whose block ``keep`` names (a pinned prefix, kv/pins.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from openinfer.kv.block_hash import BlockHash


class HostCacheIndex:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("the host KV tier needs at least one block of memory")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[BlockHash, int] = OrderedDict()  # LRU first
        self._hash_of: list[BlockHash | None] = [None] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._pins = [0] * num_slots
        self.on_evict: Callable[[BlockHash], None] | None = None
        self.keep: Callable[[BlockHash], bool] = lambda block_hash: False

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The slot holding this block (now the most recently used), if any."""
        slot = self._slot_of.get(block_hash)
        if slot is not None:
            self._slot_of.move_to_end(block_hash)
        return slot

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slot_of

    def allocate(self, block_hash: BlockHash) -> int | None:
        """A slot for a new block (evicting the least recently used unpinned one), already
        indexed under ``block_hash``; None when every slot is pinned."""
        assert block_hash not in self._slot_of
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._slot_of.items()
                           if not self._pins[s] and not self.keep(h)), None)
            if victim is None:
                return None
            slot = self._slot_of.pop(victim)
            if self.on_evict is not None:
                self.on_evict(victim)
        self._slot_of[block_hash] = slot
        self._hash_of[slot] = block_hash
        return slot

    def reserve(self) -> int | None:
        """A pinned slot not yet indexed (a block being read from a file into it)."""
        slot = self.allocate(_RESERVED)
        if slot is None:
            return None
        del self._slot_of[_RESERVED]
        self._hash_of[slot] = None
        self._pins[slot] += 1
        return slot

    def fill(self, slot: int, block_hash: BlockHash) -> None:
        """A reserved slot now holds ``block_hash`` (and is unpinned); a block that arrived
        twice keeps its first slot and the new one is freed."""
        if block_hash in self._slot_of:
            self.abandon(slot)
            return
        self._pins[slot] -= 1
        self._slot_of[block_hash] = slot
        self._hash_of[slot] = block_hash

    def abandon(self, slot: int) -> None:
        """Free a reserved slot whose block never arrived."""
        assert self._hash_of[slot] is None and self._pins[slot] == 1
        self._pins[slot] = 0
        self._free.append(slot)

    def hash_at(self, slot: int) -> BlockHash | None:
        return self._hash_of[slot]

    def pin(self, slot: int) -> None:
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        assert self._pins[slot] > 0
        self._pins[slot] -= 1

    def clear(self) -> None:
        """Forget every block (admin reset); pinned slots finish their copies first."""
        for block_hash, slot in list(self._slot_of.items()):
            if not self._pins[slot]:
                del self._slot_of[block_hash]
                self._hash_of[slot] = None
                self._free.append(slot)

    def check_integrity(self) -> None:
        indexed = set(self._slot_of.values())
        assert len(indexed) == len(self._slot_of), "two blocks share a slot"
        assert not indexed & set(self._free), "an indexed slot is also free"
        for block_hash, slot in self._slot_of.items():
            assert self._hash_of[slot] == block_hash
        assert all(p >= 0 for p in self._pins)


_RESERVED = b"reserved"
