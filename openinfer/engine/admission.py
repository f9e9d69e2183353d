"""Admission: whether the head of the waiting queue starts this step, and with what.

A waiting request starts after its longest cached prefix. Before it can, three things may make
it step aside (requests behind it go ahead; it stays first in the queue):

* its prefix blocks are in the file store, or held by a prefill instance: they are read into
  the host tier first (WAITING_FOR_KV, ``start_load``), and the request waits for them once;
* the next block it would compute is being computed by a running request (in-flight sharing,
  ``PrefixClaims``): it waits to take that block as a hit;
* it is already WAITING_FOR_KV.

It is *blocked* (nobody behind it may overtake it) when its prompt does not fit the step's
budget and chunking is off, or the KV pool has no room for it.

Pure Python over block ids and hashes.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from openinfer.config import SchedulerConfig
from openinfer.engine.request import Request, RequestStatus
from openinfer.kv.kv_manager import KVCacheManager
from openinfer.kv.prefix_hit import PrefixHit
from openinfer.kv.remote import KVTransferParams


class Verdict(enum.Enum):
    STEP_ASIDE = "step_aside"
    """Not this step; requests behind it may start."""
    BLOCKED = "blocked"
    """Not this step, and nobody behind it either (head-of-line)."""


@dataclass(frozen=True)
class Admit:
    """The request starts: after ``hit``, with ``num_tokens`` of its prompt, in ``new_blocks``."""

    hit: PrefixHit
    num_tokens: int
    new_blocks: list[list[int]]


class PrefixClaims:
    """In-flight prefix sharing: a running request that is prefilling *claims* the hashes of
    its prompt blocks nobody has cached; a waiting request whose next uncached block is
    claimed steps aside until the claimant has computed and cached it. A claim ends when its
    block is computed or its claimant stops running."""

    def __init__(self, kv: KVCacheManager, enabled: bool) -> None:
        self.kv = kv
        self.enabled = enabled and kv.enable_caching
        self.owner: dict[bytes, str] = {}
        """Claimed block hash -> the claimant's request id."""
        self._claims: dict[str, deque[tuple[int, bytes]]] = {}
        """Per claimant, (block index, hash) of the blocks it claimed, in order."""

    def next_block_is_claimed(self, req: Request, num_hit: int) -> bool:
        index = num_hit // self.kv.block_size
        return (index < (req.num_tokens - 1) // self.kv.block_size
                and req.block_hashes[index] in self.owner)

    def claim(self, req: Request) -> None:
        """Claim the request's prompt blocks after what it has computed that nobody claims."""
        if not self.enabled:
            return
        first = req.num_computed_tokens // self.kv.block_size
        last = req.num_prompt_tokens // self.kv.block_size
        claims = deque()
        for index in range(first, last):
            block_hash = req.block_hashes[index]
            if block_hash not in self.owner:
                self.owner[block_hash] = req.request_id
                claims.append((index, block_hash))
        if claims:
            self._claims[req.request_id] = claims

    def settle(self, req: Request, release_all: bool = False) -> None:
        """Drop the request's claims on blocks it has computed (all of them if it stops)."""
        claims = self._claims.get(req.request_id)
        if claims is None:
            return
        full = req.num_computed_tokens // self.kv.block_size
        while claims and (release_all or claims[0][0] < full):
            _, block_hash = claims.popleft()
            if self.owner.get(block_hash) == req.request_id:
                del self.owner[block_hash]
        if not claims:
            del self._claims[req.request_id]


class Admission:
    """Decides for the head of the waiting queue (``admit``) and starts the reads it waits for."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, claims: PrefixClaims,
                 num_lookahead_tokens: int) -> None:
        self.config = config
        self.kv = kv
        self.claims = claims
        self.num_lookahead_tokens = num_lookahead_tokens
        self.waiting_for_kv: set[str] = set()
        """Requests in WAITING_FOR_KV: their prefix blocks are being read into the host tier
        (from the file store or a prefill instance). They stay in the waiting queue, stepped
        over, until the scheduler's ``finish_load``."""

    def admit(self, req: Request, budget: int) -> Admit | Verdict:
        """Whether ``req`` starts this step with at most ``budget`` tokens (its blocks are
        allocated when it does)."""
        if req.status is RequestStatus.WAITING_FOR_KV:
            return Verdict.STEP_ASIDE
        hit = self._cached_prefix(req)
        if self._starts_store_load(req, hit) or self._starts_pull(req, hit):
            return Verdict.STEP_ASIDE
        if self.claims.next_block_is_claimed(req, hit.num_tokens):
            return Verdict.STEP_ASIDE
        remaining = req.num_tokens - hit.num_tokens
        if remaining > budget and not self.config.enable_chunked_prefill:
            return Verdict.BLOCKED
        n = min(remaining, budget)
        slots = hit.num_tokens + n
        if slots == req.num_tokens:  # it samples: a model drafter writes past it
            slots = min(slots + self.num_lookahead_tokens, req.max_num_tokens)
        # Every prefill row is computed for prompt logprobs (the runner's prefill_ends agree).
        end = req.num_tokens if req.sampling_params.prompt_logprobs is None else None
        new_blocks = self.kv.allocate_slots(req.request_id, slots, hit,
                                            num_prompt_tokens=req.num_prompt_tokens, prefill_end=end)
        if new_blocks is None:
            return Verdict.BLOCKED
        return Admit(hit, n, new_blocks)

    def _cached_prefix(self, req: Request) -> PrefixHit:
        if req.sampling_params.prompt_logprobs is not None:  # cached positions have no logits
            return PrefixHit([[] for _ in self.kv.groups], block_size=self.kv.block_size)
        # (A request that pulls its prompt takes whole blocks: the pull continues the hit.)
        tokens = req.all_token_ids if req.remote_prefill is None else None
        return self.kv.find_cached_prefix(req.block_hashes, req.num_tokens, tokens, req.cache_salt)

    def prefetch(self, queued: list[Request]) -> None:
        """Start the file-store reads of requests waiting behind the head, so that their
        blocks reach the host tier while they queue (an agent's context coming back after a
        tool call), not only once they reach the head."""
        for req in queued:
            if req.status is RequestStatus.WAITING and not req.store_prefetched:
                req.store_prefetched = True  # (once while queued: no lookup per step)
                self._starts_store_load(req, self._cached_prefix(req))

    def _starts_store_load(self, req: Request, hit: PrefixHit) -> bool:
        """Once per request: read its prefix blocks found in the file store."""
        if not hit.store_hashes or req.store_load_tried:
            return False
        req.store_load_tried = True
        return self._wait_for_kv(req, hit.store_hashes)

    def _starts_pull(self, req: Request, hit: PrefixHit) -> bool:
        """Once per request with a prefill instance's KV: pull the blocks it lacks."""
        if req.remote_prefill is None or req.remote_load_tried or not self.kv.can_pull:
            return False
        req.remote_load_tried = True
        pull = self._blocks_to_pull(req, hit)
        if not pull:  # it holds them all already: the prefill side may let go
            self.kv.release_remote(req.remote_prefill)
            return False
        return self._wait_for_kv(req, pull, req.remote_prefill)

    def _blocks_to_pull(self, req: Request, hit: PrefixHit) -> list[bytes]:
        """The prompt blocks after every local hit that the prefill instance holds: only
        what this instance lacks crosses the wire."""
        held = set(req.remote_prefill.remote_block_hashes)
        # (Blocks in the file store were loaded already, or failed to load: pull them too.)
        first = len(hit.blocks[0]) + len(hit.host_slots)
        pull = []
        for block_hash in req.block_hashes[first:(req.num_tokens - 1) // self.kv.block_size]:
            if block_hash not in held:
                break
            pull.append(block_hash)
        return pull

    def _wait_for_kv(self, req: Request, block_hashes: list[bytes],
                     source: KVTransferParams | None = None) -> bool:
        """Start reading the request's prefix blocks into the host tier (from the file
        store, or the prefill instance ``source``); False when no host slot is free."""
        if not self.kv.start_load(req.request_id, block_hashes, source):
            return False
        req.status = RequestStatus.WAITING_FOR_KV
        self.waiting_for_kv.add(req.request_id)
        return True
