"""Per-request block tables, one per layer group, over one shared block pool, with prefix caching.
Pure Python: no tensors.

All layer groups share one pool of ``num_blocks`` blocks (each group's cache tensor on
the device is a view of one buffer of pages, so a page serves whichever group takes it);
a request holds one block table per group, and admission counts every group's need
against the one pool. A request's tables grow as its tokens are scheduled:

    tokens:  | cached prefix | computed   | scheduled this step | not yet scheduled |
    blocks:  [ b0 ][ b1 ][ b2 ][ b3 ][ b4 ]
              '- hit -'  '--- held: blocks_for(computed + scheduled) ---'

Once a block is full and computed it is *cached* under its chained content hash
(block_hash.py), so any later request with the same prefix takes it by reference.

Sliding-window groups hold only the blocks their next queries can still read: entries
that fall behind the window are released as the request advances and read ``SKIPPED``
(their pages stay in the pool's prefix cache until evicted). A prefix hit must then find,
for every window group, the pages of the window behind the hit point:

    full group:    [ b0 ][ b1 ][ b2 ][ b3 ][ b4 ]        hit of 5 blocks
    window group:  [ -- ][ -- ][ -- ][ w3 ][ w4 ]        window pages of blocks 3-4 cached

The *anchor* groups (those that keep every block: full attention, MLA; all groups of a
model with window layers only) define what is "in the cache" for events and counters.
"""

from __future__ import annotations

from collections.abc import Callable

from openinfer.kv.block_hash import BlockHash
from openinfer.kv.block_pool import BlockPool, GroupPool
from openinfer.kv.cache_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from openinfer.kv.host_cache import HostCacheIndex
from openinfer.kv.partial_blocks import PartialBlocks
from openinfer.kv.pins import PinLimits, PinTable
from openinfer.kv.plan import BlockCopy, BlockLoad, KVPlan
from openinfer.kv.prefix_hit import PrefixHit
from openinfer.kv.remote import KVTransferParams
from openinfer.kv.spec import SKIPPED, FullAttentionSpec, LayerGroup, MLALatentSpec, SlidingWindowSpec

TIERS = ("L1", "L2", "L3")


class KVCacheManager:
    def __init__(self, groups: list[LayerGroup], num_blocks: int, enable_caching: bool = True,
                 snapshot_interval: int | None = None, lends_windows: bool = False,
                 pin_limits: PinLimits | None = None) -> None:
        """``snapshot_interval``: window groups keep pages cached only at window snapshots
        every that many tokens (and at a request's last full block); None: every page.
        ``lends_windows`` (an instance that serves KV to decode instances): window groups
        release nothing, so every block of a held request can be lent whole.
        ``pin_limits``: how many blocks prompts may pin (kv/pins.py), per owner and in all."""
        if not groups:
            raise ValueError("the model has no KV cache layers")
        sizes = {g.spec.block_size for g in groups}
        if len(sizes) != 1:
            raise ValueError(f"all layer groups must share one block size, got {sorted(sizes)}")
        self.groups = groups
        self.block_size = sizes.pop()
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, len(groups))
        self.pools = [GroupPool(self.pool, g) for g in range(len(groups))]
        """Each group's face of the shared pool (its own prefix-cache index)."""
        self.windows: list[tuple[int, SlidingWindowSpec]] = [
            (g, group.spec) for g, group in enumerate(groups)
            if isinstance(group.spec, SlidingWindowSpec)]
        windowed = {g for g, _ in self.windows}
        self.anchors = [g for g in range(len(groups)) if g not in windowed] or list(range(len(groups)))
        """Groups that keep every block of a request: what is "cached" means theirs."""
        self._tables: dict[str, list[list[int]]] = {}
        self.snapshot_interval = snapshot_interval
        self.lends_windows = lends_windows
        self.num_replayed_tokens = 0
        """Tokens of full-group prefix hits recomputed because the window state at their end
        was not cached (a hit resumes at the latest snapshot behind it)."""
        self._first_live: dict[str, list[int]] = {}
        """Per request, per window group (in ``windows`` order): entries before it are released."""
        self._prompt_point: dict[str, int] = {}
        """Per request: the furthest block-aligned hit point of its prompt (a snapshot)."""
        self._replayed_from: dict[str, dict[int, int]] = {}
        """Per request, per bounded-replay group: where its prefill's computed rows start."""
        self._num_cached_blocks: dict[str, int] = {}
        """Per request: how many of its leading blocks are already in the cache index."""
        self.events: list[KVEvent] = []
        """What entered and left the cache since the last ``take_events``."""
        # Freed requests' partial last blocks (not for window or compressed groups).
        self.partials = (PartialBlocks(self.pools, self.block_size) if enable_caching and all(
            type(g.spec) in (FullAttentionSpec, MLALatentSpec) for g in groups) else None)
        self.pool.on_evict = self._on_evict
        self.pins = PinTable(pin_limits or PinLimits(num_blocks // 2, num_blocks // 8), self.pools)
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.hit_tokens_by_tier = dict.fromkeys(TIERS, 0)
        # Lower tiers (attach_tiers).
        self.host: HostCacheIndex | None = None
        self.store_contains: Callable[[BlockHash], bool] | None = None
        self.plan = KVPlan()
        """Byte movement decided since the scheduler last took it (``take_plan``)."""
        self.can_pull = False
        """A KV connector is attached: requests may pull their prefix from a prefill instance."""
        self._held: dict[str, list[list[int]]] = {}
        """Block tables of finished requests kept for a decode instance to pull."""
        self.num_host_stores_skipped = 0

    def attach_tiers(self, host: HostCacheIndex | None,
                     store_contains: Callable[[BlockHash], bool] | None,
                     can_pull: bool = False) -> None:
        """The lower tiers: L2 (``host``), L3 (``store_contains``), and ``can_pull``: a KV
        connector pulls prefill instances' blocks into L2."""
        if len(self.windows) == len(self.groups):
            raise ValueError("the host and file tiers need a full-attention layer group: a "
                             "model of sliding-window layers only keeps its cache on the device")
        self.host = host
        self.store_contains = store_contains
        self.can_pull = can_pull
        if host is not None:
            host.on_evict = lambda h: self.events.append(BlockRemoved(h, "L2"))
            host.keep = self.pins.__contains__

    def take_plan(self) -> KVPlan:
        """The byte movement decided since the last call (for this step's SchedulerOutput)."""
        plan, self.plan = self.plan, KVPlan()
        return plan

    def take_events(self) -> list[KVEvent]:
        """What entered and left the cache since the last call (for the KV-event publisher)."""
        events, self.events = self.events, []
        return events

    def release_remote(self, source: KVTransferParams) -> None:
        """A prefill instance's lease this side will never pull from (it holds the blocks
        already, or the request ended first): the next step tells it to let go."""
        self.plan.releases.append(source)

    def _on_evict(self, group: int, block_hash: BlockHash) -> None:
        # A block is in L1 while every anchor group holds it: it leaves when the first one
        # evicts its page (one event, however many groups follow). The evicting pool has
        # already dropped it. Partial blocks come and go unannounced.
        if self.partials is not None and self.partials.evicted(block_hash):
            return
        anchors = self.anchors
        if group in anchors and sum(block_hash in self.pools[g] for g in anchors) == len(anchors) - 1:
            self.events.append(BlockRemoved(block_hash))

    @property
    def num_cached_blocks(self) -> int:
        """Full blocks every anchor group holds in its prefix cache (device tier)."""
        return min(self.pools[g].num_cached for g in self.anchors) - len(self.partials or ())

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_table(self, request_id: str) -> list[list[int]]:
        """The request's block ids, one list per layer group."""
        return self._tables.get(request_id) or [[] for _ in self.groups]

    # ---- prefix hits -----------------------------------------------------------------

    def find_cached_prefix(self, block_hashes: list[BlockHash], num_tokens: int,
                           token_ids: list[int] | None = None,
                           cache_salt: str | None = None) -> PrefixHit:
        """The longest cached prefix of a request, through every tier.

        At most ``num_tokens - 1`` tokens hit (whole blocks, then with ``token_ids`` a
        kept partial block after a device hit), so the last token is always computed and
        yields the logits to sample from."""
        hit = PrefixHit([[] for _ in self.groups], block_size=self.block_size)
        if not self.enable_caching:
            return hit
        limit = block_hashes[:(num_tokens - 1) // self.block_size]
        i = 0
        windowed = {g for g, _ in self.windows}
        full = [pool for g, pool in enumerate(self.pools) if g not in windowed]
        while i < len(limit) and all(limit[i] in pool for pool in full):
            i += 1
        l1 = i
        if self.host is not None:
            for block_hash in limit[i:]:
                slot = self.host.lookup(block_hash)
                if slot is None:
                    break
                hit.host_slots.append((block_hash, slot))
                i += 1
        if self.store_contains is not None:
            for block_hash in limit[i:]:
                if not self.store_contains(block_hash):
                    break
                hit.store_hashes.append(block_hash)
        if self.windows:
            # Blocks from the tiers bring their window pages; device blocks need theirs cached.
            anchored = i + len(hit.store_hashes)
            end = self._window_hit(limit, anchored, tiered_from=l1, num_tokens=num_tokens)
            hit.num_replayed_tokens = (anchored - end) * self.block_size
            del hit.host_slots[max(0, end - l1):]
            del hit.store_hashes[max(0, end - l1 - len(hit.host_slots)):]
            l1 = min(l1, end)
        for g, (table, pool) in enumerate(zip(hit.blocks, self.pools)):
            if g in windowed and not self._needs_window(g, end, num_tokens):
                first = l1  # (bounded replay: recomputed behind the request's own last rows)
            elif g in windowed:
                first = min(self._spec(g).first_needed_block(end * self.block_size), l1)
            else:
                first = 0
            table.extend([SKIPPED] * first)
            table.extend(pool.lookup(h) for h in limit[first:l1])
        if (self.partials is not None and token_ids is not None and l1 == i
                and not hit.store_hashes):
            found = self.partials.find(block_hashes, l1, token_ids, num_tokens, cache_salt)
            if found is not None:
                for table, block in zip(hit.blocks, found[0]):
                    table.append(block)
                hit.partial_rows = found[1]
        return hit

    def _spec(self, group: int) -> SlidingWindowSpec:
        return self.groups[group].spec  # type: ignore[return-value]

    def _window_hit(self, hashes: list[BlockHash], limit: int, tiered_from: int,
                    num_tokens: int) -> int:
        """The longest hit of at most ``limit`` blocks after which every window group has
        the pages its next query reads (the blocks of the window behind the hit point):
        cached on the device, or (blocks from ``tiered_from`` on) loaded from a tier with
        the rest of their block. A bounded-replay group needs them only where the request
        recomputes it from the hit point on, and from the device (``_needs_window``)."""
        valid = [True] * (limit + 1)  # valid[m]: a hit of m blocks may resume
        for g, spec in self.windows:
            pool, run = self.pools[g], 0  # run: available pages ending at block m - 1
            for m in range(1, limit + 1):
                tiered = m > tiered_from and spec.replay_rows is None
                run = run + 1 if tiered or hashes[m - 1] in pool else 0
                if self._needs_window(g, m, num_tokens):
                    valid[m] = valid[m] and m - spec.first_needed_block(m * self.block_size) <= run
        return max(m for m in range(limit + 1) if valid[m])

    def _needs_window(self, group: int, blocks: int, num_tokens: int) -> bool:
        """Whether window group ``group`` needs its pages behind a hit of ``blocks`` blocks
        (not where bounded replay recomputes that layer from further back)."""
        rows = self._spec(group).replay_rows
        return rows is None or blocks * self.block_size > num_tokens - rows

    def start_load(self, request_id: str, block_hashes: list[BlockHash],
                   source: KVTransferParams | None = None) -> bool:
        """Reserve host slots and queue a read of these blocks (from the file store, or
        the remote ``source``); False if no slot is free."""
        blocks = []
        for block_hash in block_hashes:
            slot = self.host.reserve()
            if slot is None:
                break
            blocks.append((block_hash, slot))
        if not blocks:
            return False
        self.plan.reads.append(BlockLoad(request_id, blocks, source))
        return True

    def finish_load(self, load: BlockLoad, num_loaded: int) -> None:
        """The first ``num_loaded`` blocks arrived in their slots; the rest did not."""
        for i, (block_hash, slot) in enumerate(load.blocks):
            if i < num_loaded:
                self.host.fill(slot, block_hash)
            else:
                self.host.abandon(slot)

    def finish_host_stores(self, slots: list[int]) -> None:
        """These host slots hold their blocks now (copied from the device, and queued for
        the file store when there is one): they may be reused again."""
        for slot in slots:
            self.host.unpin(slot)

    def record_prefix_query(self, num_tokens: int, hit: PrefixHit, num_from_store: int,
                            num_from_remote: int = 0) -> dict[str, int]:
        """Count one request's lookup (once); its hit tokens by tier. Of its L2 blocks,
        ``num_from_store`` came from the file store, the last ``num_from_remote`` were pulled."""
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += hit.num_tokens - num_from_remote * self.block_size
        blocks = (len(hit.host_slots) - num_from_store - num_from_remote, num_from_store)
        by_tier = {"L1": hit.num_l1_tokens, **{tier: n * self.block_size
                                               for tier, n in zip(TIERS[1:], blocks)}}
        self.hit_tokens_by_tier = {t: n + by_tier[t] for t, n in self.hit_tokens_by_tier.items()}
        self.num_replayed_tokens += hit.num_replayed_tokens
        return by_tier

    # ---- allocation ------------------------------------------------------------------

    def allocate_slots(self, request_id: str, num_tokens: int, hit: PrefixHit | None = None,
                       num_computed_tokens: int | None = None,
                       num_prompt_tokens: int | None = None,
                       prefill_end: int | None = None) -> list[list[int]] | None:
        """Grow the request's tables to cover ``num_tokens`` tokens, starting with a new
        request's cached prefix when given: its device blocks by reference, then fresh
        blocks that its host-tier blocks are copied into before the step runs. A running
        request passes ``num_computed_tokens``: window groups first release the blocks no
        query from there on reads. A new request may pass ``num_prompt_tokens``: the window
        behind the furthest hit point of its prompt is a snapshot too (the same prompt sent
        again replays nothing); ``prefill_end``: where its prefill ends (bounded replay).

        Returns the block ids added per group (hit blocks first), or None (changing
        nothing but the release) when the pool lacks room.
        """
        if num_computed_tokens is not None:
            self._release_out_of_window(request_id, num_computed_tokens)
        tables = self.block_table(request_id)
        cached = hit.blocks if hit is not None else [[] for _ in self.groups]
        wanted = [max(0, g.spec.blocks_for(num_tokens) - len(t) - len(c))
                  for g, t, c in zip(self.groups, tables, cached)]
        reviving = sum(1 for hits in cached for b in hits
                       if b != SKIPPED and self.pool.ref_count(b) == 0)
        if sum(wanted) + reviving > self.pool.num_free:
            return None
        # Every group's hits are taken before any group allocates: an allocation from the
        # shared pool would evict a later group's free cached hit, and hand it out twice.
        for hits, pool in zip(cached, self.pools):
            pool.touch([b for b in hits if b != SKIPPED])
        if hit is not None and hit.partial_rows:
            self.partials.take([hits[-1] for hits in cached])
        added = []
        for table, hits, n, pool in zip(tables, cached, wanted, self.pools):
            blocks = hits + pool.allocate(n)
            table.extend(blocks)
            added.append(blocks)
        if request_id not in self._tables and self.windows:
            self._first_live[request_id] = [
                next((i for i, b in enumerate(tables[g]) if b != SKIPPED), len(tables[g]))
                for g, _ in self.windows]
            if num_prompt_tokens:
                self._prompt_point[request_id] = (num_prompt_tokens - 1) // self.block_size
            if prefill_end is not None:
                self._replayed_from[request_id] = {g: prefill_end - spec.replay_rows
                                                   for g, spec in self.windows if spec.replay_rows}
        self._tables[request_id] = tables
        if hit is not None and (hit.blocks[0] or hit.host_slots):
            first = len(hit.blocks[0]) - bool(hit.partial_rows)
            for i, (block_hash, slot) in enumerate(hit.host_slots):
                blocks = tuple(table[first + i] for table in tables)
                for g, (pool, block) in enumerate(zip(self.pools, blocks)):
                    if getattr(self.groups[g].spec, "replay_rows", None) is None:  # (a tier may
                        pool.cache(block, block_hash)  # hold a replay page never computed)
                self.plan.loads.append(BlockCopy(block_hash, blocks, slot))
            self._num_cached_blocks[request_id] = first + len(hit.host_slots)
        return added

    def _release_out_of_window(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the window groups' blocks that lie wholly before the window behind the
        request's last full block (so that window, a snapshot, is held to the end), oldest
        first so their cached pages are evicted before newer ones. With window snapshots,
        pages outside every snapshot leave the prefix cache as they are freed."""
        tables = self._tables.get(request_id)
        if tables is None or not self.windows or self.lends_windows:
            return
        live = self._first_live[request_id]
        last_full = num_computed_tokens // self.block_size * self.block_size
        for w, (g, spec) in enumerate(self.windows):
            table = tables[g]
            end = min(spec.first_needed_block(last_full), len(table))
            if end > live[w]:
                if self.snapshot_interval is not None:
                    point = self._prompt_point.get(request_id, 0)
                    prompt = range(spec.first_needed_block(point * self.block_size), point)
                    for i in range(live[w], end):
                        if i not in prompt and not spec.in_snapshot(i, self.snapshot_interval):
                            self.pool.uncache(table[i])
                self.pools[g].free(table[live[w]:end])
                table[live[w]:end] = [SKIPPED] * (end - live[w])
                live[w] = end

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """The request keeps only its first ``num_tokens`` tokens (the rejected drafts of a
        speculative step go): blocks past them are freed, tail first. ``num_tokens`` is at
        least the computed tokens of its last ``allocate_slots``, so the window behind them
        is still held (windows are released behind verified tokens only); cached blocks stay
        cached (their content is what their hash names); compressed entries of
        groups completed by the dropped tokens are written again when those groups complete."""
        tables = self._tables.get(request_id)
        if tables is None:
            return
        for group, pool, table in zip(self.groups, self.pools, tables):
            keep = group.spec.blocks_for(num_tokens)
            pool.free([b for b in reversed(table[keep:]) if b != SKIPPED])
            del table[keep:]
        if request_id in self._num_cached_blocks:
            self._num_cached_blocks[request_id] = min(self._num_cached_blocks[request_id],
                                                      num_tokens // self.block_size)

    def cache_blocks(self, request_id: str, block_hashes: list[BlockHash],
                     token_ids: list[int], num_computed_tokens: int) -> list[BlockHash]:
        """Index the request's blocks that are now full and computed; returns the hashes
        that newly entered the cache."""
        if not self.enable_caching or request_id not in self._tables:
            return []
        done = self._num_cached_blocks.get(request_id, 0)
        full = min(num_computed_tokens // self.block_size, len(block_hashes))
        stored = []
        tables = self._tables[request_id]
        replayed_from = self._replayed_from.get(request_id, {})
        for i in range(done, full):
            new = [table[i] != SKIPPED and i * self.block_size >= replayed_from.get(g, 0)
                   and pool.cache(table[i], block_hashes[i])
                   for g, (pool, table) in enumerate(zip(self.pools, tables))]
            if not all(new[g] for g in self.anchors):
                continue
            stored.append(block_hashes[i])
            self.pins.cached_again(block_hashes[i])  # (after the device let it go)
            bs = self.block_size
            parent, tokens = block_hashes[i - 1] if i else None, tuple(token_ids[i * bs:(i + 1) * bs])
            self.events.append(BlockStored(block_hashes[i], parent, tokens))
            if self.host is not None and block_hashes[i] not in self.host:
                slot = self.host.allocate(block_hashes[i])
                if slot is None:  # every slot is pinned by a copy in flight
                    self.num_host_stores_skipped += 1
                    continue
                self.host.pin(slot)  # until the copy at the start of the next step
                self.plan.stores.append(
                    BlockCopy(block_hashes[i], tuple(table[i] for table in tables), slot))
                self.events.append(BlockStored(block_hashes[i], parent, tokens, "L2"))
        self._num_cached_blocks[request_id] = max(done, full)
        return stored

    # ---- pinned prefixes ---------------------------------------------------------------

    def pin_prefix(self, block_hashes: list[BlockHash], num_tokens: int, ttl_s: float,
                   owner: str | None, now: float) -> int:
        """Pin the cached whole blocks of a prompt's first ``num_tokens`` tokens until
        ``now + ttl_s`` (kv/pins.py); returns the tokens pinned (0: refused by a cap)."""
        cached = lambda h: (all(h in self.pools[g] for g in self.anchors)  # noqa: E731
                            or (self.host is not None and h in self.host))
        pinned = self.pins.pin_cached(block_hashes[:num_tokens // self.block_size], cached,
                                      ttl_s, owner, now) if self.enable_caching else []
        self.plan.pins += pinned
        return len(pinned) * self.block_size

    def free(self, request_id: str) -> None:
        """Release all of the request's blocks, tail first (so the tail is evicted first)."""
        tables = self._tables.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        self._first_live.pop(request_id, None)
        self._prompt_point.pop(request_id, None)
        self._replayed_from.pop(request_id, None)
        if tables is None:
            return
        for pool, table in zip(self.pools, tables):
            pool.free([b for b in reversed(table) if b != SKIPPED])

    def hold(self, request_id: str, block_hashes: list[BlockHash],
             num_tokens: int) -> dict[BlockHash, tuple[int, ...]]:
        """Instead of freeing a finished request, keep its cached full blocks of the first
        ``num_tokens`` tokens referenced (for a decode instance to pull) and free the
        rest; returns hash -> device block per group of what is held. ``release`` frees
        them."""
        if self.windows and not self.lends_windows:
            raise ValueError("window groups release their blocks: this instance lends no KV")
        tables = self._tables.pop(request_id, None)
        num_cached = self._num_cached_blocks.pop(request_id, 0)
        if tables is None:
            return {}
        n = min(num_cached, num_tokens // self.block_size, len(block_hashes))
        for pool, table in zip(self.pools, tables):
            pool.free(table[n:][::-1])
        self._held[request_id] = [table[:n] for table in tables]
        return {h: tuple(table[i] for table in tables) for i, h in enumerate(block_hashes[:n])}

    def release(self, request_id: str) -> None:
        for pool, table in zip(self.pools, self._held.pop(request_id, [])):
            pool.free(table[::-1])

    @property
    def num_held(self) -> int:
        return len(self._held)

    def reset_cache(self) -> int:
        """Forget every cached prefix (admin reset); returns how many blocks were cached."""
        count = self.num_cached_blocks
        self.pool.reset_cache()
        if self.partials is not None:
            self.partials.clear()
        self.pins.clear()
        if self.host is not None:
            self.host.clear()
        self.events.append(AllBlocksCleared())
        return count

    def check_integrity(self) -> None:
        """Assert every block's refcount equals the number of tables that hold it."""
        held: dict[int, int] = {}
        for tables in [*self._tables.values(), *self._held.values()]:
            for table in tables:
                for b in table:
                    if b != SKIPPED:
                        held[b] = held.get(b, 0) + 1
        self.pool.check_integrity(held)
        if self.host is not None:
            self.host.check_integrity()

    @property
    def num_requests(self) -> int:
        return len(self._tables)
