"""Which replica gets a request. Pure Python over integers and block hashes.

Policies (``Router.choose``):

* ``round_robin``: the next healthy replica in turn.
* ``least_load``: the fewest requests in flight. The router counts a request from the
  moment it routes it until its response ends, so a burst cannot pile onto a replica
  whose own counters have not caught up yet; KV usage breaks ties.
* ``power_of_two``: the less loaded of two replicas drawn at random.
* ``cache_aware``: the replica holding the longest prefix of the request's KV blocks,
  from an exact index of each replica's KV events (any tier), or, for replicas without
  events, from an approximate index of the prompts routed to them. Overridden by
  least_load when the load is imbalanced (SGLang's guard: max - min > ``balance_abs``
  and max > ``balance_rel`` x min), and when no replica holds any of the prefix.

Session affinity (a ``user`` field or ``x-session-id`` header) keeps a session on its
replica unless that replica is unhealthy or the load guard trips.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

import msgpack

from openinfer.kv.block_hash import BlockHash

POLICIES = ("round_robin", "least_load", "power_of_two", "cache_aware")
EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


def parse_event_batch(payload: bytes) -> list[dict]:
    """A replica's KV-event batch (msgpack ``{"events": [...]}``, vLLM's schema) as the
    events the index applies; ValueError for anything else, so a broken or hostile stream
    is refused whole instead of half applied. Unknown event types pass (and are skipped)."""
    try:
        batch = msgpack.unpackb(payload)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise ValueError(f"undecodable KV event batch: {e}") from None
    events = batch.get("events") if isinstance(batch, dict) else None
    if not isinstance(events, list):
        raise ValueError("a KV event batch is a map with a list of events")
    for event in events:
        if not isinstance(event, dict):
            raise ValueError("a KV event is a map")
        if event.get("type") in ("BlockStored", "BlockRemoved"):
            hashes = event.get("block_hashes")
            if not (isinstance(hashes, list) and all(isinstance(h, bytes) for h in hashes)):
                raise ValueError(f"{event['type']}.block_hashes is a list of byte strings")
            if not isinstance(event.get("medium") or "", str):
                raise ValueError(f"{event['type']}.medium is a string")
    return events


class WorkerCacheIndex:
    """The block hashes one replica holds (any tier), kept exact from its KV events."""

    def __init__(self) -> None:
        self._media: dict[BlockHash, set[str]] = {}
        self.next_seq = 0
        self.live = False
        """True once events have been applied without a gap since the last reset."""
        self.epoch: bytes | None = None
        """The publisher life the index follows (its replay says which), once known."""

    def reset(self) -> None:
        self._media.clear()
        self.next_seq = 0
        self.live = False

    def started_over(self, next_seq: int, epoch: bytes | None) -> bool:
        """Whether a publisher that gives its next batch ``next_seq`` in its life ``epoch``
        (what its replay ends with) is a new life of the one this index followed: a
        restarted engine, whose cache started empty."""
        changed = epoch is not None and self.epoch is not None and epoch != self.epoch
        return changed or next_seq < self.next_seq

    def apply(self, seq: int, events: list[dict]) -> bool:
        """Apply one batch; False (applying nothing) when ``seq`` shows batches were missed
        (the caller replays from ``next_seq``). A sequence back at 0 means the replica
        restarted: its old index is dropped."""
        if seq == 0 and self.next_seq != 0:
            self.reset()
        if seq != self.next_seq:
            return seq < self.next_seq  # an old duplicate is harmless
        for e in events:
            kind = e.get("type")
            if kind == "BlockStored":
                for h in e["block_hashes"]:
                    self._media.setdefault(h, set()).add(e.get("medium") or "?")
            elif kind == "BlockRemoved":
                for h in e["block_hashes"]:
                    media = self._media.get(h)
                    if media is not None:
                        media.discard(e.get("medium") or "?")
                        if not media:
                            del self._media[h]
            elif kind == "AllBlocksCleared":
                self._media.clear()
        self.next_seq = seq + 1
        self.live = True
        return True

    def match(self, hashes: list[BlockHash]) -> int:
        return _leading(hashes, self._media)

    def __len__(self) -> int:
        return len(self._media)


class ApproxIndex:
    """Block hashes of prompts recently routed to a replica (when it sends no events):
    an LRU guess at what it caches."""

    def __init__(self, capacity_blocks: int = 200_000) -> None:
        self.capacity = capacity_blocks
        self._seen: OrderedDict[BlockHash, None] = OrderedDict()

    def insert(self, hashes: list[BlockHash]) -> None:
        for h in hashes:
            self._seen[h] = None
            self._seen.move_to_end(h)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def match(self, hashes: list[BlockHash]) -> int:
        return _leading(hashes, self._seen)

    def clear(self) -> None:
        self._seen.clear()

    def __len__(self) -> int:
        return len(self._seen)


def _leading(hashes: list[BlockHash], held) -> int:
    """How many of the leading hashes ``held`` contains."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


CREDENTIAL_HEADERS = frozenset({"authorization", "x-api-key"})


@dataclass
class Worker:
    url: str
    healthy: bool = True
    draining: bool = False
    """Taken out of rotation by an operator (``/admin/workers/drain``): it finishes what it
    has and gets nothing new until undrained."""
    in_flight: int = 0
    """Requests routed here whose responses have not ended."""
    kv_usage: float = 0.0
    external_load: int = 0
    """Requests the replica reported (running + waiting) beyond those this router had in
    flight there when it asked: load from other routers or direct clients."""
    index: WorkerCacheIndex = field(default_factory=WorkerCacheIndex)
    approx: ApproxIndex = field(default_factory=ApproxIndex)
    routed: int = 0
    trusted: bool = True
    """Named at start-up (or started by us): it may see the client's credentials. A replica
    added later through the admin API never receives a client's Authorization header."""

    def forwarded_headers(self, headers: dict[str, str]) -> dict[str, str]:
        """The client's headers as this replica may receive them."""
        if self.trusted:
            return headers
        return {k: v for k, v in headers.items() if k.lower() not in CREDENTIAL_HEADERS}

    def match(self, hashes: list[BlockHash]) -> int:
        return self.index.match(hashes) if self.index.live else self.approx.match(hashes)

    @property
    def load(self) -> int:
        """Requests this replica is busy with: ours counted from the moment they are routed
        (a replica's own report lags by up to a poll interval, and counting only from the
        first token makes a hot spot of the replica that is slowest to answer), plus what
        it last reported from elsewhere."""
        return self.in_flight + self.external_load

    def report(self, running_and_waiting: int, in_flight_at_report: int) -> None:
        self.external_load = max(0, running_and_waiting - in_flight_at_report)


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "cache_aware"
    balance_abs: int = 8
    balance_rel: float = 1.5
    seed: int = 0


@dataclass
class Decision:
    worker: Worker
    reason: str
    """round_robin, least_load, power_of_two, cache_hit, no_cache_hit, load_override, affinity."""
    matched_blocks: int = 0


class Router:
    def __init__(self, config: RouterConfig, workers: list[Worker]) -> None:
        if config.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {config.policy!r}")
        self.config = config
        self.workers = workers
        self._rng = random.Random(config.seed)
        self._next = 0
        self._sessions: OrderedDict[str, str] = OrderedDict()

    def healthy(self) -> list[Worker]:
        """The replicas in rotation: healthy and not draining."""
        return [w for w in self.workers if w.healthy and not w.draining]

    def choose(self, hashes: list[BlockHash], session: str | None = None,
               exclude: set[str] = frozenset()) -> Decision | None:
        candidates = [w for w in self.healthy() if w.url not in exclude]
        if not candidates:
            return None
        decision = self._choose(candidates, hashes, session)
        worker = decision.worker
        # The guess is kept only while the replica's events do not say what it holds: kept
        # always, it grew to its 200,000 blocks per replica (~30 MiB of the router's RSS over
        # a 10,000-request soak) while never consulted.
        if worker.index.live:
            worker.approx.clear()
        else:
            worker.approx.insert(hashes)
        if session is not None:
            self._sessions[session] = decision.worker.url
            self._sessions.move_to_end(session)
            while len(self._sessions) > 100_000:
                self._sessions.popitem(last=False)
        return decision

    def _choose(self, candidates: list[Worker], hashes: list[BlockHash],
                session: str | None) -> Decision:
        policy = self.config.policy
        if policy == "round_robin":
            worker = candidates[self._next % len(candidates)]
            self._next += 1
            return Decision(worker, "round_robin")
        if policy == "power_of_two":
            pair = self._rng.sample(candidates, min(2, len(candidates)))
            return Decision(min(pair, key=_load_key), "power_of_two")
        least = min(candidates, key=_load_key)
        if policy == "least_load":
            return Decision(least, "least_load")
        loads = [w.load for w in candidates]
        if (max(loads) - min(loads) > self.config.balance_abs
                and max(loads) > self.config.balance_rel * min(loads)):
            return Decision(least, "load_override")
        if session is not None and session in self._sessions:
            pinned = next((w for w in candidates if w.url == self._sessions[session]), None)
            if pinned is not None:
                return Decision(pinned, "affinity", pinned.match(hashes))
        matches = [(w.match(hashes), w) for w in candidates]
        best = max(m for m, _ in matches)
        if best == 0:
            return Decision(least, "no_cache_hit")
        worker = min((w for m, w in matches if m == best), key=_load_key)
        return Decision(worker, "cache_hit", best)


def _load_key(w: Worker) -> tuple[int, float, int]:
    # Equal loads: the fuller KV cache loses, then the replica given the least so far, so
    # ties spread.
    return (w.load, w.kv_usage, w.routed)
