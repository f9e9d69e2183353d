"""Block pool and KV manager: pure Python, exact block ids, invariants."""

from __future__ import annotations

import pytest

from openinfer.kv.block_pool import BlockPool
from openinfer.kv.kv_manager import KVCacheManager
from openinfer.kv.spec import FullAttentionSpec, group_layers


def _manager(num_blocks: int, block_size: int = 4, layers: int = 2) -> KVCacheManager:
    spec = FullAttentionSpec(block_size, num_kv_heads=2, head_dim=8, dtype="float32")
    return KVCacheManager(group_layers([spec] * layers), num_blocks)


def test_pool_allocates_and_frees_with_refcounts():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 1
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    pool.free(a[::-1])
    assert pool.num_free == 4
    pool.check_integrity()
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([0])


def test_pool_integrity_catches_mismatch():
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    pool.check_integrity({blocks[0]: 1, blocks[1]: 1})
    with pytest.raises(AssertionError):
        pool.check_integrity({blocks[0]: 1})


def test_layer_groups_share_specs():
    full = FullAttentionSpec(16, 8, 64, "float32")
    groups = group_layers([full] * 3)
    assert len(groups) == 1 and groups[0].layers == (0, 1, 2)
    assert groups[0].bytes_per_block == 3 * 2 * 16 * 8 * 64 * 4


def test_allocate_slots_grows_tables_block_by_block():
    kv = _manager(num_blocks=5)
    assert kv.allocate_slots("a", 5) == [[0, 1]]          # 5 tokens -> 2 blocks of 4
    assert kv.allocate_slots("a", 8) == [[]]              # still fits in 2 blocks
    assert kv.allocate_slots("a", 9) == [[2]]
    assert kv.block_table("a") == [[0, 1, 2]]
    assert kv.allocate_slots("b", 12) is None             # needs 3, only 2 free: nothing taken
    assert kv.block_table("b") == [[]]
    assert kv.allocate_slots("b", 8) == [[3, 4]]
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    kv.check_integrity()
    assert kv.pool.num_free == 5 and kv.num_requests == 0


def test_free_is_idempotent_for_unknown_requests():
    kv = _manager(num_blocks=2)
    kv.free("nobody")
    kv.check_integrity()
