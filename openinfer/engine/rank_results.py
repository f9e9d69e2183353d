"""Combining the workers' answers to one call when there are several ranks (tensor
parallelism), for the calls whose answer is not simply rank 0's: pure Python."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

from openinfer.kv.plan import BlockLoad


class EveryRank:
    """Things each rank finishes on its own, at its own time (its share of a block read,
    its side of a KV lease): one is done once every rank has reported it."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._reported: dict[Hashable, list[Any]] = {}
        """A thing's key -> what each rank that finished it so far reported."""

    def done(self, per_rank: Sequence[Iterable[tuple[Hashable, Any]]]
             ) -> list[tuple[Hashable, list[Any]]]:
        """(key, every rank's report) of the things now finished on every rank, given
        each rank's newly finished (key, report) pairs."""
        finished = []
        for reports in per_rank:
            for key, report in reports:
                so_far = self._reported.setdefault(key, [])
                so_far.append(report)
                if len(so_far) == self.num_ranks:
                    finished.append((key, self._reported.pop(key)))
        return finished

    @property
    def num_partial(self) -> int:
        """Things some ranks have finished and others not yet."""
        return len(self._reported)


class ReadsAcrossRanks(EveryRank):
    """Each tensor-parallel rank reads its own share of a block load (its KV heads' bytes,
    from its own files or its own prefill rank) and reports it done when its part is. The
    load is done once every rank's part is, with the blocks that arrived on every rank: a
    block missing on one rank is missing (the request recomputes it)."""

    def finished(self, per_rank: Sequence[Sequence[tuple[BlockLoad, int]]]
                 ) -> list[tuple[BlockLoad, int]]:
        """The loads now finished on every rank, given each rank's newly finished ones."""
        if self.num_ranks == 1:
            return list(per_rank[0])
        keyed = [[((load.request_id, tuple(load.blocks)), (load, n)) for load, n in reads]
                 for reads in per_rank]
        return [(reports[0][0], min(n for _, n in reports)) for _, reports in self.done(keyed)]


def ended_on_every_rank(tracker: EveryRank, per_rank: Sequence[Sequence[str]]) -> list[str]:
    """The KV leases every rank's KV server has now ended (released or expired)."""
    if tracker.num_ranks == 1:
        return list(per_rank[0])
    return [lease for lease, _ in tracker.done([[(lease, None) for lease in ended]
                                                for ended in per_rank])]


LEASE_COUNTS = frozenset({"kv_leases", "kv_leases_expired"})
"""Counts of leases, which every rank holds alike (one lease, a share on each rank)."""


def summed(per_rank: Sequence[Mapping]) -> dict:
    """The ranks' counters added up, key by key (nested maps too, e.g. bytes by direction);
    LEASE_COUNTS are rank 0's."""
    total: dict = {}
    for stats in per_rank:
        for key, value in stats.items():
            if isinstance(value, Mapping):
                total[key] = summed([total.get(key, {}), value])
            elif key in LEASE_COUNTS:
                total.setdefault(key, value)
            else:
                total[key] = total.get(key, 0) + value
    return total
