"""Combining the workers' answers to one call when there are several ranks (tensor
parallelism), for the calls whose answer is not simply rank 0's: pure Python."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from openinfer.kv.plan import BlockLoad


class ReadsAcrossRanks:
    """Each tensor-parallel rank reads its own share of a block load (its KV heads' bytes,
    from its own files) and reports it done when its part is. The load is done once every
    rank's part is, with the blocks that arrived on every rank: a block missing on one
    rank is missing (the request recomputes it)."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._arrived: dict[tuple, list[int]] = {}
        """A load's key -> the blocks each rank that finished it so far got."""

    def finished(self, per_rank: Sequence[Sequence[tuple[BlockLoad, int]]]
                 ) -> list[tuple[BlockLoad, int]]:
        """The loads now finished on every rank, given each rank's newly finished ones."""
        if self.num_ranks == 1:
            return list(per_rank[0])
        done = []
        for finished in per_rank:
            for load, num_loaded in finished:
                key = (load.request_id, tuple(load.blocks))
                arrived = self._arrived.setdefault(key, [])
                arrived.append(num_loaded)
                if len(arrived) == self.num_ranks:
                    del self._arrived[key]
                    done.append((load, min(arrived)))
        return done

    @property
    def num_partial(self) -> int:
        """Loads some ranks have finished and others not yet."""
        return len(self._arrived)


def summed(per_rank: Sequence[Mapping]) -> dict:
    """The ranks' counters added up, key by key (nested maps too, e.g. bytes by direction)."""
    total: dict = {}
    for stats in per_rank:
        for key, value in stats.items():
            if isinstance(value, Mapping):
                total[key] = summed([total.get(key, {}), value])
            else:
                total[key] = total.get(key, 0) + value
    return total
