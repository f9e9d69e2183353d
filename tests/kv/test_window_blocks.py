"""Sliding-window layer groups in the KV manager: blocks behind the window are released as a
request advances (O(window) per request), prefix hits need the window's pages, pools stay
consistent."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from openinfer.kv.block_hash import extend_block_hashes
from openinfer.kv.cache_events import BlockRemoved, BlockStored
from openinfer.kv.kv_manager import KVCacheManager
from openinfer.kv.spec import (
    SKIPPED,
    FullAttentionSpec,
    SlidingWindowSpec,
    group_layers,
    page_bytes,
)

BLOCK = 4
WINDOW = 6  # a query reads itself and the 5 keys before it: 2 or 3 blocks


def _specs(window_only: bool = False) -> list:
    window = SlidingWindowSpec(BLOCK, 2, 8, "float32", WINDOW)
    full = FullAttentionSpec(BLOCK, 2, 8, "float32")
    return [window, window] if window_only else [full, window, full, window]


def _manager(num_blocks: int, window_only: bool = False) -> KVCacheManager:
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
    kv = _manager(128)
    tokens = list(range(100))
    live = _run(kv, "a", tokens, prompt_len=40, chunk=16)
    spec = kv.groups[1].spec
    assert max(live) <= spec.max_live_blocks(16)
    assert live[-1] <= spec.max_live_blocks(1)
    table_full, table_window = kv.block_table("a")
    assert len(table_full) == len(table_window) == 25  # positions stay aligned
    assert SKIPPED not in table_full                    # full attention keeps everything
    # The window group kept exactly the window behind the last full block (96) when the
    # last token (99) was scheduled: a snapshot point, and all that query 99 reads.
    first = spec.first_needed_block(96)
    assert table_window[:first] == [SKIPPED] * first and SKIPPED not in table_window[first:]
    assert kv.pool.num_free == 128 - 25 - (25 - first)  # one full, one window group
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
    kv.pool._evict(kv.pools[1].lookup(_hashes(tokens)[8]))
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
    kv.pool._evict(kv.pools[1].lookup(_hashes(tokens)[0]))
    assert kv.events == []
    kv.pool._evict(kv.pools[0].lookup(_hashes(tokens)[0]))
    assert [type(e) for e in kv.events] == [BlockRemoved]
    kv.free("a")

    only = _manager(64, window_only=True)
    _run(only, "a", tokens, prompt_len=33, chunk=8)
    only.free("a")
    assert only.anchors == [0] and only.find_cached_prefix(_hashes(tokens), 33).num_tokens == 32


def test_groups_share_one_pool_of_equal_pages():
    # 1 full layer and 3 window layers: groups of one layer each, so every page has one size.
    full = FullAttentionSpec(BLOCK, 2, 8, "float32")
    window = SlidingWindowSpec(BLOCK, 2, 8, "float32", WINDOW)
    groups = group_layers([window, full, window, window])
    assert [(g.spec.kind, g.layers) for g in groups] == [
        ("sliding_window", (0,)), ("sliding_window", (2,)), ("sliding_window", (3,)),
        ("full_attention", (1,))]
    assert page_bytes(groups) == groups[0].bytes_per_block == groups[3].bytes_per_block
    # Admission counts every group's blocks against the one pool.
    kv = KVCacheManager(groups, 13)
    assert kv.allocate_slots("a", 12) is not None  # 3 blocks in each of 4 groups
    assert kv.pool.num_free == 1
    assert kv.allocate_slots("b", 1) is None        # needs 4, one per group
    kv.check_integrity()
    kv.free("a")
    assert kv.allocate_slots("b", 12) is not None
    kv.free("b")
    kv.check_integrity()


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "step", "free"]), st.integers(0, 4),
                          st.integers(1, 12)), max_size=50))
def test_random_prefill_decode_hit_free_sequences_keep_every_pool_consistent(ops):
    """Requests over a 2-letter alphabet share prefixes; pools are tight (window groups
    smaller); every step releases what fell behind the window."""
    kv = _manager(30)
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


def test_window_snapshots_keep_window_pages_only_at_snapshots():
    # Snapshots every 16 tokens (4 blocks): the windows behind 16 and 32 are blocks 2-3 and
    # 6-7; the request ends at 41 tokens, so the window behind its last full block (40),
    # blocks 8-9, stays too. Every other window page leaves the cache as it is released.
    bounded = KVCacheManager(group_layers(_specs()), 128, snapshot_interval=16)
    per_block = KVCacheManager(group_layers(_specs()), 128)
    tokens = list(range(41))
    for kv in (bounded, per_block):
        _run(kv, "a", tokens, prompt_len=20, chunk=8)
        kv.free("a")
        kv.check_integrity()
    hashes = _hashes(tokens)
    cached = [i for i, h in enumerate(hashes) if h in bounded.pools[1]]
    assert cached == [2, 3, 6, 7, 8, 9]
    assert all(h in per_block.pools[1] for h in hashes)
    # The same 41 tokens: the last full block's snapshot serves the whole hit.
    assert bounded.find_cached_prefix(hashes, 41).num_tokens == 40
    # A prompt that leaves them after 30 tokens: the full groups hold 7 blocks (28 tokens),
    # the latest snapshot behind them is at 16, so 12 tokens are replayed.
    other = tokens[:30] + [99] * 15
    hit = bounded.find_cached_prefix(_hashes(other), len(other))
    assert (hit.num_tokens, hit.num_replayed_tokens) == (16, 12)
    hit = per_block.find_cached_prefix(_hashes(other), len(other))
    assert (hit.num_tokens, hit.num_replayed_tokens) == (28, 0)
    bounded.record_prefix_query(len(other), bounded.find_cached_prefix(_hashes(other), 45), 0)
    assert bounded.num_replayed_tokens == 12


def test_rollback_keeps_the_window_of_the_kept_tokens():
    """A speculative step computes 4 drafts past the 36 verified tokens and all are rejected:
    the tail block goes back to the pool, and the window behind the verified tokens (the
    point the step's allocation released behind) is still held for the next query."""
    tokens = list(range(44))
    hashes = _hashes(tokens)
    kv = KVCacheManager(group_layers(_specs()), 64)
    spec = kv.groups[1].spec
    assert kv.allocate_slots("a", 36) is not None
    kv.cache_blocks("a", hashes, tokens, 36)
    assert kv.allocate_slots("a", 41, num_computed_tokens=36) is not None  # 1 + 4 drafts
    assert [len(t) for t in kv.block_table("a")] == [11, 11]
    used = kv.usage
    kv.rollback("a", 37)  # the last token and no draft
    full, window = kv.block_table("a")
    assert len(full) == len(window) == 10 and kv.usage < used
    assert SKIPPED not in window[spec.first_needed_block(37):]
    kv.check_integrity()
    assert kv.allocate_slots("a", 38, num_computed_tokens=37) is not None
    kv.free("a")
    kv.check_integrity()
    assert kv.usage == 0


def test_a_hit_is_taken_in_every_group_before_any_group_allocates():
    """The groups share one pool, where free cached blocks wait oldest first: a new request's
    hit blocks of a later group may stand before anything else free. They are taken first,
    so no block serves two groups (it did: the full group's new block was the window group's
    hit, the prefill overwrote those keys, and a request resumed after preemption got other
    tokens)."""
    kv = _manager(40)
    a, d = list(range(8)), list(range(100, 108))
    for rid, tokens in (("a", a), ("d", d)):
        assert kv.allocate_slots(rid, 8) is not None
        kv.cache_blocks(rid, _hashes(tokens), tokens, 8)
    assert kv.allocate_slots("b", 4 * (kv.pool.num_free // 2)) is not None  # every unused block
    kv.free("a")
    kv.free("d")  # free, oldest first: a's group-0 blocks, a's group-1 blocks, then d's
    tokens = a + [7, 7, 7, 7]
    hit = kv.find_cached_prefix(_hashes(tokens), len(tokens))
    assert hit.num_tokens == 8
    assert kv.allocate_slots("c", 12, hit) is not None
    tables = kv.block_table("c")
    used = [b for table in tables for b in table if b != SKIPPED]
    assert len(used) == len(set(used)), tables
    kv.check_integrity()
