"""Prefix caching over integers: stable hashes, eviction order, hits by reference, invariants."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from openinfer.kv.block_hash import ROOT_HASH, extend_block_hashes, hash_block
from openinfer.kv.block_pool import BlockPool
from openinfer.kv.cache_events import AllBlocksCleared, BlockRemoved, BlockStored
from openinfer.kv.kv_manager import KVCacheManager
from openinfer.kv.spec import FullAttentionSpec, group_layers

BLOCK = 4


def _manager(num_blocks: int, groups: int = 1) -> KVCacheManager:
    """Layers with different head counts land in different layer groups (own pools)."""
    specs = [FullAttentionSpec(BLOCK, heads, 8, "float32") for heads in range(1, groups + 1)]
    return KVCacheManager(group_layers(specs), num_blocks)


def test_block_hashes_chain_are_salted_and_agree_across_processes():
    tokens = list(range(10))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, BLOCK)
    assert len(hashes) == 2  # the partial third block has no hash
    assert hashes[0] == hash_block(ROOT_HASH, [0, 1, 2, 3])
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6, 7])
    assert hash_block(ROOT_HASH, [4, 5, 6, 7]) != hashes[1]  # a block's hash names its prefix
    salted: list[bytes] = []
    extend_block_hashes(salted, tokens, BLOCK, cache_salt="tenant-a")
    assert salted[0] != hashes[0] and salted[1] != hashes[1]
    code = ("from openinfer.kv.block_hash import extend_block_hashes as e; h = []; "
            "e(h, list(range(10)), 4); print(h[1].hex())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": "123", "PATH": ""}, check=True)
    assert other.stdout.strip() == hashes[1].hex()


def test_uncached_blocks_are_reused_first_and_a_tail_goes_before_its_head():
    pool = BlockPool(4)
    a = pool.allocate(3)
    for i, b in enumerate(a):
        pool.cache(b, bytes([i]) * 32)
    plain = pool.allocate(1)
    pool.free(a[::-1])                        # a request frees its table tail first
    pool.free(plain)
    assert pool.num_free == 4 and pool.num_cached == 3
    assert pool.allocate(1) == plain          # the never-cached block goes first
    assert pool.allocate(1) == [a[2]]         # then the tail of the cached request
    assert pool.lookup(bytes([2]) * 32) is None and pool.lookup(bytes([0]) * 32) == a[0]
    pool.check_integrity()


def test_hits_are_shared_by_reference_and_capped_before_the_last_token():
    kv = _manager(8)
    prompt = list(range(12))                  # exactly three blocks
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt, BLOCK)
    assert kv.allocate_slots("a", 12) is not None
    kv.cache_blocks("a", hashes, prompt, 12)
    assert [type(e) for e in kv.events] == [BlockStored] * 3
    assert kv.events[1].parent_hash == hashes[0] and kv.events[1].token_ids == (4, 5, 6, 7)
    hit = kv.find_cached_prefix(hashes, len(prompt))
    assert hit.num_tokens == 8                # the last token is always computed
    assert kv.allocate_slots("b", 13, hit) is not None
    assert kv.block_table("b")[0][:2] == kv.block_table("a")[0][:2]
    assert kv.pools[0].ref_count(kv.block_table("a")[0][0]) == 2
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    assert kv.usage == 0 and kv.pools[0].num_cached == 3
    assert kv.reset_cache() == 3 and isinstance(kv.events[-1], AllBlocksCleared)
    assert kv.find_cached_prefix(hashes, 12).num_tokens == 0
    kv.check_integrity()


def test_eviction_reports_removed_blocks():
    kv = _manager(3)
    prompt = list(range(8))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt, BLOCK)
    kv.allocate_slots("a", 8)
    kv.cache_blocks("a", hashes, prompt, 8)
    kv.free("a")
    kv.events.clear()
    kv.allocate_slots("b", 12)                # needs every block: both cached ones go
    assert {e.block_hash for e in kv.events if isinstance(e, BlockRemoved)} == set(hashes)
    kv.free("b")
    kv.check_integrity()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 5),
                          st.integers(1, 14)), max_size=60))
def test_random_alloc_hit_free_sequences_keep_the_pool_consistent(ops):
    """Requests over a 2-letter alphabet share prefixes often; the pool is tight."""
    kv = _manager(10, groups=2)
    live: dict[str, list[int]] = {}
    hashes: dict[str, list[bytes]] = {}
    content: dict[int, tuple[int, ...]] = {}  # block -> the tokens written when it was cached
    partial: dict[int, tuple[int, ...]] = {}  # block -> the rows of a kept partial block

    def cache(rid: str) -> None:
        tokens = live[rid]
        for block_hash in kv.cache_blocks(rid, hashes[rid], tokens, len(tokens)):
            i = hashes[rid].index(block_hash)
            content[kv.block_table(rid)[0][i]] = tuple(tokens[i * BLOCK:(i + 1) * BLOCK])

    for step, (op, who, n) in enumerate(ops):
        rid = f"r{who}"
        if op == "add" and rid not in live:
            tokens = [(who * n + i) % 2 for i in range(n)]
            hashes[rid] = []
            extend_block_hashes(hashes[rid], tokens, BLOCK)
            hit = kv.find_cached_prefix(hashes[rid], len(tokens), tokens)
            assert hit.num_tokens <= len(tokens) - 1
            for i, block in enumerate(hit.blocks[0]):  # a hit holds exactly the tokens asked for
                if hit.partial_rows and i == len(hit.blocks[0]) - 1:
                    assert partial[block] == tuple(tokens[i * BLOCK:i * BLOCK + hit.partial_rows])
                else:
                    assert content[block] == tuple(tokens[i * BLOCK:(i + 1) * BLOCK])
            assert len(hit.blocks[0]) == len(hit.blocks[1])  # both layer groups agree
            if kv.allocate_slots(rid, len(tokens), hit) is not None:
                live[rid] = tokens
                cache(rid)
        elif op == "grow" and rid in live:
            tokens = live[rid] + [step % 2] * n
            if kv.allocate_slots(rid, len(tokens)) is not None:
                live[rid] = tokens
                extend_block_hashes(hashes[rid], tokens, BLOCK)
                cache(rid)
        elif op == "free" and rid in live:
            tokens = live[rid]
            kv.partials.keep(kv.block_table(rid), hashes[rid], tokens, len(tokens), None)
            if len(tokens) % BLOCK:
                partial[kv.block_table(rid)[0][len(tokens) // BLOCK]] = tuple(
                    tokens[len(tokens) // BLOCK * BLOCK:])
            kv.free(rid)
            del live[rid]
        kv.check_integrity()
    for rid in list(live):
        kv.free(rid)
    kv.check_integrity()
    assert kv.usage == 0


def _finished(kv: KVCacheManager, rid: str, tokens: list[int], salt: str | None = None) -> None:
    """A request that computed ``tokens`` and ended."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, BLOCK, salt)
    hit = kv.find_cached_prefix(hashes, len(tokens), tokens, salt)
    assert kv.allocate_slots(rid, len(tokens), hit) is not None
    kv.cache_blocks(rid, hashes, tokens, len(tokens))
    if kv.partials is not None:
        kv.partials.keep(kv.block_table(rid), hashes, tokens, len(tokens), salt)
    kv.free(rid)


def _hit(kv: KVCacheManager, tokens: list[int], salt: str | None = None):
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, BLOCK, salt)
    return kv.find_cached_prefix(hashes, len(tokens), tokens, salt)


def test_a_partial_last_block_is_kept_taken_once_and_evicted_without_events():
    kv = _manager(10, groups=2)
    _finished(kv, "a", list(range(10)))      # two full blocks, then 2 rows
    assert kv.num_cached_blocks == 2          # partial blocks are not counted as cached
    assert [type(e) for e in kv.events] == [BlockStored] * 2
    turn2 = list(range(10)) + [50, 51, 52]
    hit = _hit(kv, turn2)
    assert (hit.num_tokens, hit.partial_rows, len(hit.blocks[1])) == (10, 2, 3)
    assert _hit(kv, list(range(10))).num_tokens == 8   # its last token is computed
    assert _hit(kv, list(range(9)) + [7, 7]).num_tokens == 8  # other rows: no hit
    assert _hit(kv, turn2, salt="t").num_tokens == 0   # nor under another tenant's salt
    assert kv.allocate_slots("b", len(turn2), hit) is not None
    assert kv.block_table("b")[0][2] == hit.blocks[0][2]  # taken, written on by "b" ...
    assert _hit(kv, turn2).num_tokens == 8    # ... so nobody else finds it
    assert kv.record_prefix_query(len(turn2), hit, 0)["L1"] == 10
    kv.free("b")
    _finished(kv, "c", [9, 9, 9, 9, 9, 9])    # one full block, then 2 rows
    kv.events.clear()
    assert len(kv.partials) == 1
    full = kv.num_cached_blocks
    assert kv.allocate_slots("d", 20) is not None  # every block: the cache is emptied
    assert all(isinstance(e, BlockRemoved) for e in kv.events)
    assert len(kv.events) == full == len({e.block_hash for e in kv.events})  # full blocks, once
    assert len(kv.partials) == 0 and kv.pool.num_cached == 0
    kv.free("d")
    _finished(kv, "e", list(range(6)))
    assert len(kv.partials) == 1 and kv.reset_cache() == 1 and len(kv.partials) == 0
    kv.check_integrity()


def test_window_groups_keep_no_partial_blocks():
    from openinfer.kv.spec import SlidingWindowSpec

    kv = KVCacheManager(group_layers([FullAttentionSpec(BLOCK, 1, 8, "float32"),
                                      SlidingWindowSpec(BLOCK, 2, 8, "float32", 8)]), 8)
    assert kv.partials is None
    _finished(kv, "a", list(range(10)))
    assert _hit(kv, list(range(12))).num_tokens == 8
