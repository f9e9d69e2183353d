"""Pinned prefixes (kv/pins.py): caps per owner and in all, refresh and expiry, and what a pin
holds in each tier: the device pool reuses pinned blocks last, the host tier never evicts them,
the file store never collects their files before the pin ends."""

from __future__ import annotations

import os
import time

from openinfer.kv.block_hash import extend_block_hashes
from openinfer.kv.block_pool import BlockPool
from openinfer.kv.host_cache import HostCacheIndex
from openinfer.kv.kv_manager import KVCacheManager
from openinfer.kv.pins import PinLimits, PinTable
from openinfer.kv.spec import BlockLayout, FullAttentionSpec, group_layers
from openinfer.transfer.file_store import FileStore

H = [bytes([i]) * 32 for i in range(10)]


def test_caps_refresh_and_expiry():
    pins = PinTable(PinLimits(max_blocks=4, max_blocks_per_owner=3))
    assert pins.pin(H[:3], 10, "a", now=0)
    assert not pins.pin(H[3:4], 10, "a", now=0)  # a's cap: 3 blocks
    assert pins.pin(H[:1] + H[3:4], 10, "b", now=0)  # one shared with a: 4 in all
    assert not pins.pin(H[4:5], 10, "b", now=0)  # the cap in all, even under b's own
    assert (pins.num_pinned_by("a"), pins.num_pinned_by("b"), len(pins)) == (3, 2, 4)
    assert pins.pin(H[5:9], 10, None, now=0) is False  # no owner: capped in all only
    assert pins.pin(H[1:2], 30, "a", now=5)  # a refresh takes no room
    assert pins.expiry(H[1]) == 35
    assert sorted(pins.expire(now=10)) == [H[0], H[2], H[3]]  # (H[0]: a's and b's end)
    assert H[1] in pins and (pins.num_pinned_by("a"), pins.num_pinned_by("b")) == (1, 0)
    assert pins.expire(now=34) == [] and pins.expire(now=35) == [H[1]]
    assert len(pins) == 0 and pins.num_refused == 3


def test_the_device_pool_reuses_pinned_blocks_last():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for b, h in zip(blocks, H):
        pool.cache(b, h)
    pool.set_pinned(blocks[0], True)
    pool.free(blocks)
    assert pool.allocate(3) == blocks[1:]  # the pinned one, freed first, goes last
    assert pool.lookup(H[0]) == blocks[0]
    assert pool.allocate(1) == blocks[:1] and pool.lookup(H[0]) is None  # under pressure
    pool.free(blocks)
    pool.check_integrity()


def test_the_host_tier_keeps_pinned_blocks():
    host = HostCacheIndex(2)
    host.keep = {H[0]}.__contains__
    assert host.allocate(H[0]) is not None and host.allocate(H[1]) is not None
    assert host.allocate(H[2]) is not None  # H[1] evicted, not the older pinned H[0]
    assert H[0] in host and H[1] not in host
    host.keep = {H[0], H[2]}.__contains__
    assert host.allocate(H[3]) is None  # every slot pinned: the store is skipped


def test_the_manager_pins_cached_blocks_and_plans_their_files():
    kv = KVCacheManager(group_layers([FullAttentionSpec(4, 1, 8, "float32")]), 8)
    tokens = list(range(14))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, 4)
    kv.allocate_slots("a", 14)
    kv.cache_blocks("a", hashes, tokens, 10)  # two blocks computed so far
    assert kv.pin_prefix(hashes, 12, 60, None, now=100) == 8  # the cached ones only
    assert kv.take_plan().pins == [(hashes[0], 160), (hashes[1], 160)]
    kv.free("a")
    assert kv.pool.num_free == 8 and kv.allocate_slots("b", 24) is not None  # 6 blocks
    assert kv.find_cached_prefix(hashes, 14).num_tokens == 8  # the pinned pair survived
    kv.free("b")
    kv.pins.expire(now=160)
    kv.check_integrity()
    assert not kv.pool._pinned


def test_the_file_store_keeps_pinned_files_past_its_budget(tmp_path):
    layout = BlockLayout.of(group_layers([FullAttentionSpec(4, 1, 8, "float32")]), "pins")
    payload = bytes(layout.block_bytes)
    store = FileStore(tmp_path, layout, capacity_bytes=1 << 30)
    until = time.time() + 3600
    store.pin(H[0], until)  # before it is written: dated when it is
    store.write(H[0], payload)
    store.write(H[1], payload)
    store.pin(H[1], until)
    assert os.stat(store.path_of(H[0])).st_mtime == until == os.stat(store.path_of(H[1])).st_mtime
    store.read(H[0])  # a read never moves a pin's date back
    assert os.stat(store.path_of(H[0])).st_mtime == until
    for h in H[2:8]:
        store.write(h, payload)
    store.capacity_bytes = 3 * os.stat(store.path_of(H[0])).st_size
    store.collect_garbage()
    assert store.contains(H[0]) and store.contains(H[1])  # the pinned ones, over budget
    assert not any(store.contains(h) for h in H[2:8])
