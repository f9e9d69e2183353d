"""Expert-parallel load balancing (EPLB): which expert each physical slot of each rank holds.

Routed experts are not used evenly (a few are hot on any real traffic), and under expert
parallelism a step waits for the rank with the most tokens. DeepSeek's remedy, followed
here over plain lists (their "global" policy):

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

Their "hierarchical" policy, for ranks on several machines and a model whose routing
picks expert groups first (DeepSeek-V3's ``n_group`` / ``topk_group``): the groups are
packed onto the nodes first (by group load, a node's groups staying unless that costs more
than ``STICKINESS``), and then each node's experts are replicated and packed onto its own
ranks as above. Every replica of an expert then lives on its group's node, so a token's
few groups are few nodes: less traffic between machines, at some cost in balance.
``place`` picks it when the nodes divide the groups and the ranks, else the global policy.

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
            if expert >= 0:  # (-1: an expert not among these, see rebalance_hierarchical)
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


def place(load: Sequence[float], num_ranks: int, num_physical: int,
          current: Placement | None = None, num_groups: int = 1, num_nodes: int = 1,
          policy: str = "auto") -> Placement:
    """The hierarchical placement where it applies (the ranks span ``num_nodes`` machines
    that divide the ranks and the model's ``num_groups`` expert groups) and ``policy`` is
    not "global", else the global one."""
    if policy == "global":
        return rebalance(load, num_ranks, num_physical, current)
    fits = (num_nodes > 1 and num_groups % num_nodes == 0 and num_ranks % num_nodes == 0
            and len(load) % num_groups == 0  # and a node's slots hold one replica per rank:
            and num_physical // num_nodes <= len(load) // num_nodes * (num_ranks // num_nodes))
    if fits or policy == "hierarchical":  # (forced: checked at start-up)
        return rebalance_hierarchical(load, num_ranks, num_physical, num_groups, num_nodes,
                                      current)
    return rebalance(load, num_ranks, num_physical, current)


def rebalance_hierarchical(load: Sequence[float], num_ranks: int, num_physical: int,
                           num_groups: int, num_nodes: int, current: Placement | None = None,
                           stickiness: float = STICKINESS) -> Placement:
    """Expert groups (``num_groups`` runs of consecutive experts) packed onto the nodes
    (``num_nodes``, each ``num_ranks / num_nodes`` consecutive ranks), then each node's
    experts placed on its ranks by ``rebalance``."""
    num_experts = len(load)
    if num_experts % num_groups or num_groups % num_nodes or num_ranks % num_nodes \
            or num_physical % num_ranks:
        raise ValueError(f"{num_nodes} nodes do not divide {num_groups} expert groups of "
                         f"{num_experts} experts, {num_ranks} ranks and {num_physical} slots")
    per_group = num_experts // num_groups
    ranks_per_node, slots_per_node = num_ranks // num_nodes, num_physical // num_nodes
    group_load = [sum(load[g * per_group:(g + 1) * per_group]) for g in range(num_groups)]
    held_by = [-1] * num_groups  # the node holding each group now (its first expert's)
    if current is not None:
        for slot, expert in enumerate(current.physical_to_logical):
            node = slot // slots_per_node
            if held_by[expert // per_group] < 0:
                held_by[expert // per_group] = node
    node_groups = _pack_groups(group_load, num_nodes, num_groups // num_nodes, held_by,
                               stickiness * sum(load) / num_nodes)
    slots: list[int] = []
    for node, groups in enumerate(node_groups):
        experts = [g * per_group + i for g in sorted(groups) for i in range(per_group)]
        local = {expert: i for i, expert in enumerate(experts)}
        before = None
        if current is not None:  # this node's slots now, in its own numbering
            mine = current.physical_to_logical[node * slots_per_node:(node + 1) * slots_per_node]
            before = Placement(tuple(local.get(e, -1) for e in mine), ranks_per_node)
        placed = rebalance([load[e] for e in experts], ranks_per_node, slots_per_node, before,
                           stickiness)
        slots.extend(experts[i] for i in placed.physical_to_logical)
    return Placement(tuple(slots), num_ranks)


def _pack_groups(weights: Sequence[float], num_bins: int, per_bin: int,
                 held_by: Sequence[int], slack: float) -> list[list[int]]:
    """Items (heaviest first) onto bins of ``per_bin`` items each, each to the least loaded
    bin with room, or to the bin that holds it now if that is within ``slack`` of it."""
    load, assigned = [0.0] * num_bins, [[] for _ in range(num_bins)]
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        open_bins = [b for b in range(num_bins) if len(assigned[b]) < per_bin]
        best = min(open_bins, key=lambda b: (load[b], b))
        held = held_by[item]
        if held in open_bins and load[held] <= load[best] + slack:
            best = held
        assigned[best].append(item)
        load[best] += weights[item]
    return assigned


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
