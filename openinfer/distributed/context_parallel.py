"""Prefill context parallelism (``--prefill-context-parallel-size N``): one long prompt
chunk's tokens computed by N ranks at once, each holding the whole model and a whole KV
cache.

A chunk of ``n >= min_tokens`` tokens is cut into 2N pieces; rank r computes pieces r and
2N-1-r (zig-zag: under causal attention a late piece costs more than an early one, and
each rank gets one of each, so their work is even). Each piece is attended to as a
sequence of its own that ends where the piece ends and shares the prompt's block table,
so the attention backends run unchanged: all they need is every earlier position's K/V in
the cache, which the layers provide by exchanging the split tokens' K/V (one all-gather
per layer) and writing every rank's into their slots. Every rank's cache thus holds the
whole prompt, in the layout decode reads. Decodes and short chunks are computed by every
rank whole.

After the forward pass one all-reduce assembles the step's hidden states on every rank
(each row from one owner: a split token's piece owner, rank 0 for the rest; zeros
elsewhere, so the sum is exact), so every rank samples the same tokens from the same bits
and keeps the same request state, as under tensor parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from openinfer.distributed.parallel_state import _count
from openinfer.kernels.paged_attention import write_kv

MIN_SPLIT_TOKENS_PER_RANK = 8
"""A chunk is split when it has at least this many tokens per rank (each piece then has
at least half as many): shorter ones cost less computed whole than exchanged."""


@dataclass(frozen=True)
class ContextParallel:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def pieces(self, n: int, rank: int) -> list[tuple[int, int]]:
        """Offsets [start, end) within an n-token chunk of the two pieces ``rank`` computes."""
        cuts = [n * i // (2 * self.size) for i in range(2 * self.size + 1)]
        mirror = 2 * self.size - 1 - rank
        return [(cuts[rank], cuts[rank + 1]), (cuts[mirror], cuts[mirror + 1])]


_CP = ContextParallel()


def get_cp() -> ContextParallel:
    return _CP


def set_cp(cp: ContextParallel) -> None:
    global _CP
    _CP = cp


@dataclass
class ContextParallelStep:
    """One step's split, the same on every rank: which rows of the step's full batch each
    rank computes, and how the layers exchange the split rows' K/V."""

    cp: ContextParallel
    local_rows: torch.Tensor
    """The full batch's rows this rank computes, in its local batch order."""
    local_split: torch.Tensor
    """Positions in the local batch of this rank's split rows (sent to the others)."""
    split_rows: list[torch.Tensor]
    """Each rank's split rows (full-batch row indices), in its sending order."""
    other_slots: torch.Tensor
    """Cache slots of the other ranks' split rows, in the order the exchange returns them."""
    num_rows: int

    def exchange_kv(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """Write the other ranks' split tokens' K/V into this layer's ``cache`` (a float8
        cache's with the layer's scales)."""
        most = max(len(rows) for rows in self.split_rows)
        if most == 0:
            return
        mine = torch.stack([k[self.local_split], v[self.local_split]])  # [2, n, H, D]
        padded = mine.new_zeros(2, most, *mine.shape[2:])
        padded[:, :mine.shape[1]] = mine
        parts = [torch.empty_like(padded) for _ in range(self.cp.size)]
        _count("all_gather", padded)
        dist.all_gather(parts, padded, group=self.cp.group)
        others = torch.cat([part[:, :len(rows)] for r, (part, rows)
                            in enumerate(zip(parts, self.split_rows)) if r != self.cp.rank], 1)
        write_kv(cache, others[0], others[1], self.other_slots, k_scale, v_scale)

    def assemble_hidden(self, local: torch.Tensor) -> torch.Tensor:
        """The full batch's hidden states on every rank, from this rank's rows."""
        owned = torch.ones(len(self.local_rows), dtype=torch.bool)
        if self.cp.rank != 0:  # rank 0 provides every row computed whole
            owned[:] = False
            owned[self.local_split] = True
        full = local.new_zeros(self.num_rows, local.shape[1])
        full[self.local_rows[owned]] = local[owned]
        _count("all_reduce", full)
        dist.all_reduce(full, group=self.cp.group)
        return full


def plan_step(cp: ContextParallel, query_lens: list[int], seq_lens: list[int],
              block_tables: list[list[int]], block_size: int,
          ) -> tuple[ContextParallelStep, list[int], list[int], list[list[int]]]:
    """The split of a step (sequences ordered decodes first, as the runner packs them):
    the step, and this rank's virtual sequences (query lens, seq lens, block tables)."""
    min_tokens = MIN_SPLIT_TOKENS_PER_RANK * cp.size
    local_rows: list[int] = []
    local_split: list[int] = []
    split_rows: list[list[int]] = [[] for _ in range(cp.size)]
    split_slots: list[list[int]] = [[] for _ in range(cp.size)]
    q_out, s_out, t_out = [], [], []
    start = 0
    for q, s, table in zip(query_lens, seq_lens, block_tables):
        first_position = s - q
        if q < min_tokens:  # whole, on every rank
            local_rows.extend(range(start, start + q))
            q_out.append(q)
            s_out.append(s)
            t_out.append(table)
        else:
            for rank in range(cp.size):
                for a, b in cp.pieces(q, rank):
                    split_rows[rank].extend(range(start + a, start + b))
                    for p in range(first_position + a, first_position + b):
                        split_slots[rank].append(table[p // block_size] * block_size
                                                 + p % block_size)
                    if rank == cp.rank:
                        local_split.extend(range(len(local_rows), len(local_rows) + b - a))
                        local_rows.extend(range(start + a, start + b))
                        q_out.append(b - a)
                        s_out.append(first_position + b)
                        t_out.append(table)
        start += q
    others = [slot for r in range(cp.size) if r != cp.rank for slot in split_slots[r]]
    step = ContextParallelStep(
        cp, torch.tensor(local_rows, dtype=torch.long),
        torch.tensor(local_split, dtype=torch.long),
        [torch.tensor(rows, dtype=torch.long) for rows in split_rows],
        torch.tensor(others, dtype=torch.long), start)
    return step, q_out, s_out, t_out
