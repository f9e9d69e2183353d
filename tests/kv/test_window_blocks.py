"""Sliding-window layer groups in the KV manager: blocks behind the window are released as a
request advances (O(window) per request), prefix hits need the window's pages, pools stay
consistent."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from openinfer.kv.block_hash import extend_block_hashes
from openinfer.kv.kv_manager import BlockRemoved, BlockStored, KVCacheManager
from openinfer.kv.spec import (
    SKIPPED,
    FullAttentionSpec,
    SlidingWindowSpec,
    blocks_per_group,
    group_layers,
)

BLOCK = 4
WINDOW = 6  # a query reads itself and the 5 keys before it: 2 or 3 blocks


def _specs(window_only: bool = False) -> list:
    window = SlidingWindowSpec(BLOCK, 2, 8, "float32", WINDOW)
    full = FullAttentionSpec(BLOCK, 2, 8, "float32")
    return [window, window] if window_only else [full, window, full, window]


def _manager(num_blocks: int | list[int], window_only: bool = False) -> KVCacheManager:
    return KVCacheManager(group_layers(_specs(window_only)), num_blocks)


def _hashes(tokens: list[int]) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, BLOCK)
    return out


def _run(kv: KVCacheManager, rid: str, tokens: list[int], prompt_len: int,
         chunk: int = 64) -> list[int]:
    """Prefill ``prompt_len`` tokens in chunks, then decode the rest one by one, caching
    full blocks after each step as the scheduler does; returns the window group's live
    block count after each step."""
    hashes = _hashes(tokens)
    hit = kv.find_cached_prefix(hashes, len(tokens))
    done = hit.num_tokens
    first = min(prompt_len, done + chunk)
    assert kv.allocate_slots(rid, first, hit) is not None
    live = []
    while True:
        kv.cache_blocks(rid, hashes, tokens, first)
        live.append(sum(b != SKIPPED for b in kv.block_table(rid)[kv.windows[0][0]]))
        kv.check_integrity()
        if first == len(tokens):
            return live
        done, first = first, min(len(tokens), first + (chunk if first < prompt_len else 1))
        assert kv.allocate_slots(rid, first, num_computed_tokens=done) is not None


def test_window_groups_hold_only_the_blocks_their_window_reads():
    kv = _manager(64)
    tokens = list(range(100))
    live = _run(kv, "a", tokens, prompt_len=40, chunk=16)
    spec = kv.groups[1].spec
    assert max(live) <= spec.max_live_blocks(16)
    assert live[-1] <= spec.max_live_blocks(1)
    table_full, table_window = kv.block_table("a")
    assert len(table_full) == len(table_window) == 25  # positions stay aligned
    assert SKIPPED not in table_full                    # full attention keeps everything
    # The window group kept exactly the blocks that the next query (position 100) reads.
    first = spec.first_needed_block(100)
    assert table_window[:first] == [SKIPPED] * first and SKIPPED not in table_window[first:]
    assert kv.pools[0].num_free == 64 - 25 and kv.pools[1].num_free == 64 - (25 - first)
    kv.free("a")
    kv.check_integrity()
    assert kv.usage == 0


def test_a_hit_resumes_where_every_window_group_has_its_pages():
    kv = _manager(64)
    tokens = list(range(41))
    _run(kv, "a", tokens, prompt_len=41, chunk=8)
    kv.free("a")
    # Pages released behind the window stay cached: the full 10-block prefix hits, and the
    # window group takes only the pages its next query reads.
    hit = kv.find_cached_prefix(_hashes(tokens), len(tokens))
    assert hit.num_tokens == 40
    first = kv.groups[1].spec.first_needed_block(40)
    assert hit.blocks[1][:first] == [SKIPPED] * first
    assert all(b != SKIPPED for b in hit.blocks[1][first:]) and len(hit.blocks[1]) == 10
    # Evict the window page of block 8 only: no hit point from 9 blocks on has its window,
    # and a hit at 8 blocks needs pages 6-7, which are still cached.
    window_pool = kv.pools[1]
    window_pool._evict(window_pool.lookup(_hashes(tokens)[8]))
    hit = kv.find_cached_prefix(_hashes(tokens), len(tokens))
    assert hit.num_tokens == 32
    assert kv.allocate_slots("b", 41, hit) is not None
    kv.check_integrity()
    kv.free("b")
    kv.check_integrity()


def test_events_follow_the_full_groups_and_window_only_models_cache_too():
    kv = _manager(64)
    tokens = list(range(33))
    _run(kv, "a", tokens, prompt_len=33, chunk=33)
    stored = [e for e in kv.events if isinstance(e, BlockStored)]
    assert len(stored) == 8 and kv.num_cached_blocks == 8
    kv.events.clear()
    # Evicting a window page is not a removal from the cache; evicting a full page is.
    kv.pools[1]._evict(kv.pools[1].lookup(_hashes(tokens)[0]))
    assert kv.events == []
    kv.pools[0]._evict(kv.pools[0].lookup(_hashes(tokens)[0]))
    assert [type(e) for e in kv.events] == [BlockRemoved]
    kv.free("a")

    only = _manager(64, window_only=True)
    _run(only, "a", tokens, prompt_len=33, chunk=8)
    only.free("a")
    assert only.anchors == [0] and only.find_cached_prefix(_hashes(tokens), 33).num_tokens == 32


def test_pool_sizes_give_window_groups_their_bound_and_full_groups_the_rest():
    groups = group_layers(_specs())
    full, window = groups[0].bytes_per_block, groups[1].bytes_per_block
    sizes = blocks_per_group(groups, 1000 * (full + window), max_num_seqs=4,
                             max_num_batched_tokens=32)
    bound = 2 * (4 * (groups[1].spec.max_live_blocks(0) + 1) + 32 // BLOCK)
    assert sizes == [(1000 * (full + window) - bound * window) // full, bound]
    # Too little memory for the bound to save anything: an even split.
    assert blocks_per_group(groups, 20 * (full + window), 4, 32) == [20, 20]
    assert blocks_per_group(group_layers(_specs(window_only=True)), 50 * full, 4, 32) == [50]


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "step", "free"]), st.integers(0, 4),
                          st.integers(1, 12)), max_size=50))
def test_random_prefill_decode_hit_free_sequences_keep_every_pool_consistent(ops):
    """Requests over a 2-letter alphabet share prefixes; pools are tight (window groups
    smaller); every step releases what fell behind the window."""
    kv = _manager([24, 12])
    live: dict[str, tuple[list[int], int]] = {}  # tokens, computed
    for step, (op, who, n) in enumerate(ops):
        rid = f"r{who}"
        if op == "add" and rid not in live:
            tokens = [(who * n + i) % 2 for i in range(n + 4)]
            hit = kv.find_cached_prefix(_hashes(tokens), len(tokens))
            for g, table in enumerate(hit.blocks):
                assert len(table) == len(hit.blocks[0])
                if g == 1:  # the window behind the hit point is there, nothing before it
                    first = kv.groups[1].spec.first_needed_block(hit.num_tokens)
                    assert table[:first] == [SKIPPED] * first and SKIPPED not in table[first:]
            if kv.allocate_slots(rid, min(len(tokens), hit.num_tokens + 5), hit) is not None:
                live[rid] = (tokens, min(len(tokens), hit.num_tokens + 5))
        elif op == "step" and rid in live:
            tokens, computed = live[rid]
            tokens = tokens + [step % 2] * (1 if computed == len(tokens) else 0)
            target = min(len(tokens), computed + n)
            if kv.allocate_slots(rid, target, num_computed_tokens=computed) is not None:
                kv.cache_blocks(rid, _hashes(tokens), tokens, target)
                live[rid] = (tokens, target)
        elif op == "free" and rid in live:
            kv.free(rid)
            del live[rid]
        kv.check_integrity()
    for rid in list(live):
        kv.free(rid)
    kv.check_integrity()
    assert kv.usage == 0
