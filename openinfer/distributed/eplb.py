"""Expert-parallel load balancing (EPLB): which expert each physical slot of each rank holds.

Routed experts are not used evenly (a few are hot on any real traffic), and under expert
parallelism a step waits for the rank with the most tokens. DeepSeek's remedy, followed
here over plain lists (their "global" policy; the per-node hierarchy comes with
multi-node serving):

1. replicate: with ``num_physical`` slots for ``num_experts`` experts, every expert gets
   one replica and each further slot goes to the expert with the highest load per replica
   (its tokens are then split evenly over its replicas);
2. pack: the replicas, heaviest first, each go to the rank with the least load that still
   has a free slot (every rank ends with exactly ``slots_per_rank``), avoiding a rank that
   already holds the same expert; but a rank that holds the expert now wins when its load
   is within ``STICKINESS`` of a mean rank load of the least (on near-even loads the
   greedy order alone would reshuffle most experts for nothing);
3. keep in place: a replica whose rank already held that expert keeps its slot, so only
   the experts new to a rank have to be sent there.

Pure Python over integers and floats, like the scheduler: deterministic, so every rank
computes the same placement from the same loads.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

STICKINESS = 0.02
"""How much more load (a fraction of the mean rank load) packing accepts to leave an
expert on a rank that holds it already."""


@dataclass(frozen=True)
class Placement:
    physical_to_logical: tuple[int, ...]
    """The expert in each physical slot; slot ``p`` lives on rank ``p // slots_per_rank``."""
    num_ranks: int

    @property
    def slots_per_rank(self) -> int:
        return len(self.physical_to_logical) // self.num_ranks

    @property
    def num_experts(self) -> int:
        return max(self.physical_to_logical) + 1

    def replicas(self) -> list[list[int]]:
        """The physical slots of each expert, lowest first."""
        out: list[list[int]] = [[] for _ in range(self.num_experts)]
        for slot, expert in enumerate(self.physical_to_logical):
            out[expert].append(slot)
        return out

    def rank_experts(self, rank: int) -> tuple[int, ...]:
        s = self.slots_per_rank
        return self.physical_to_logical[rank * s:(rank + 1) * s]

    def rank_loads(self, load: Sequence[float]) -> list[float]:
        """Each rank's tokens when every expert's tokens split evenly over its replicas."""
        copies = [len(r) for r in self.replicas()]
        out = [0.0] * self.num_ranks
        for slot, expert in enumerate(self.physical_to_logical):
            out[slot // self.slots_per_rank] += load[expert] / copies[expert]
        return out

    def imbalance(self, load: Sequence[float]) -> float:
        """Max over mean rank load: 1.0 is perfect balance (the step time is set by the max)."""
        loads = self.rank_loads(load)
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean else 1.0


def initial_placement(num_experts: int, num_ranks: int, num_redundant: int = 0) -> Placement:
    """Experts in order, rank 0 first, then replicas of experts 0, 1, ... in the redundant
    slots: what a rank loads before any load is known."""
    slots = [*range(num_experts), *(e % num_experts for e in range(num_redundant))]
    if len(slots) % num_ranks:
        raise ValueError(f"{num_ranks} ranks do not divide {num_experts} experts + "
                         f"{num_redundant} redundant slots")
    return Placement(tuple(slots), num_ranks)


def replicate(load: Sequence[float], num_physical: int, max_copies: int) -> list[int]:
    """Replicas of each expert: one each, then every further slot to the expert with the
    highest load per replica (ties: the lower expert), at most ``max_copies`` (the ranks:
    two replicas on one rank would split nothing)."""
    if num_physical > len(load) * max_copies:
        raise ValueError(f"{num_physical} slots would put more than {max_copies} replicas of "
                         f"an expert on {len(load)} experts")
    copies = [1] * len(load)
    heap = [(-float(w), e) for e, w in enumerate(load)]
    heapq.heapify(heap)
    for _ in range(num_physical - len(load)):
        _, e = heapq.heappop(heap)
        copies[e] += 1
        if copies[e] < max_copies:
            heapq.heappush(heap, (-load[e] / copies[e], e))
    return copies


def rebalance(load: Sequence[float], num_ranks: int, num_physical: int,
              current: Placement | None = None, stickiness: float = STICKINESS) -> Placement:
    """The placement for ``load`` (tokens per expert over the last window), preferring the
    ranks that hold an expert ``current``-ly and keeping the replicas that stay on their rank
    in their slots."""
    num_experts = len(load)
    if num_physical < num_experts or num_physical % num_ranks:
        raise ValueError(f"{num_physical} physical slots cannot hold {num_experts} experts "
                         f"on {num_ranks} ranks evenly")
    per_rank = num_physical // num_ranks
    copies = replicate(load, num_physical, num_ranks)
    items = sorted(((load[e] / copies[e], e) for e in range(num_experts) for _ in range(copies[e])),
                   key=lambda item: (-item[0], item[1]))
    slack = stickiness * sum(load) / num_ranks
    holders = [set() for _ in range(num_experts)]  # the ranks holding each expert now
    for rank in range(num_ranks if current else 0):
        for expert in current.rank_experts(rank):
            holders[expert].add(rank)
    rank_load = [0.0] * num_ranks
    assigned: list[list[int]] = [[] for _ in range(num_ranks)]
    for weight, expert in items:
        open_ranks = [r for r in range(num_ranks) if len(assigned[r]) < per_rank]
        fresh = [r for r in open_ranks if expert not in assigned[r]] or open_ranks
        rank = min(fresh, key=lambda r: (rank_load[r], r))
        staying = [r for r in fresh if r in holders[expert]
                   and rank_load[r] <= rank_load[rank] + slack]
        if staying:
            rank = min(staying, key=lambda r: (rank_load[r], r))
        assigned[rank].append(expert)
        rank_load[rank] += weight
    slots: list[int] = []
    for rank, experts in enumerate(assigned):
        slots.extend(_keep_in_place(experts, current.rank_experts(rank) if current else ()))
    return Placement(tuple(slots), num_ranks)


def _keep_in_place(experts: list[int], before: Sequence[int]) -> list[int]:
    """``experts`` ordered into a rank's slots so that an expert the slot held before stays."""
    todo = list(experts)
    slots: list[int | None] = [None] * len(experts)
    for i, old in enumerate(before[:len(slots)]):
        if old in todo:
            todo.remove(old)
            slots[i] = old
    fill = iter(todo)
    return [e if e is not None else next(fill) for e in slots]
