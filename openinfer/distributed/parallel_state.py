"""The tensor-parallel group of this process: which rank it is, how many there are, and
the two collectives the sharded layers need.

A process runs one model, so the group is process state (as in vLLM and SGLang): the
executor sets it before the model is built, and the layers read it when they are
constructed (to size their shards) and when they run (to reduce or gather). With one rank
every collective is the identity and no ``torch.distributed`` group exists.

Megatron's split, which the layers follow: a column-parallel linear holds a slice of the
output features (q/k/v heads, gate/up rows) and needs no communication; the row-parallel
linear after it holds the matching slice of the input features and sums its partial
products over the ranks (one all-reduce per attention block and per MLP block). The
embedding and LM head split the vocabulary.

Expert parallelism (``ExpertParallel``) changes only the MoE layers: instead of every rank
holding a slice of every expert, each rank holds whole experts (its ``slots_per_rank``
physical slots) and computes them for the tokens routed there. Its ranks are either the
tensor-parallel ones (every rank has every token; the same all-reduce combines the
experts' outputs) or data-parallel attention ranks, one engine each with its own requests
(``across_data_parallel``: tokens are gathered from every rank and the outputs
reduce-scattered back; openinfer/layers/moe.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVES: dict[str, list[int]] = {"all_reduce": [0, 0], "all_gather": [0, 0],
                                     "reduce_scatter": [0, 0], "all_to_all": [0, 0]}
"""Calls and payload bytes (this rank's tensor) of each collective so far, for
benchmarks/bench_tensor_parallel.py (two integer adds per call)."""

COLLECTIVE_TIMEOUT = timedelta(minutes=5)
"""Backstop for a collective whose peer hangs (a dead peer fails it at once)."""


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, in place."""
        if self.size > 1:
            _count("all_reduce", x)
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, rank 0 first."""
        if self.size == 1:
            return x
        _count("all_gather", x)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def split(self, n: int, what: str) -> int:
        """This rank's share of ``n`` (heads, features): an error if it does not divide."""
        if n % self.size:
            raise ValueError(f"tensor_parallel_size {self.size} does not divide {what} ({n})")
        return n // self.size


def _count(name: str, x: torch.Tensor) -> None:
    entry = COLLECTIVES[name]
    entry[0] += 1
    entry[1] += x.numel() * x.element_size()


_TP = TensorParallel()


def get_tp() -> TensorParallel:
    return _TP


def set_tp(tp: TensorParallel) -> None:
    global _TP
    _TP = tp


@dataclass(frozen=True)
class ExpertParallel:
    """Whole experts spread over the ranks (``--enable-expert-parallel``); ``size`` 1: every
    expert on every rank, as under plain tensor parallelism (which then slices them)."""

    rank: int = 0
    size: int = 1
    enabled: bool = False
    num_redundant: int = 0
    """Physical expert slots beyond one per logical expert (EPLB replicas of hot experts)."""
    group: dist.ProcessGroup | None = None
    across_data_parallel: bool = False
    """The ranks are data-parallel engines, each with its own tokens."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            _count("all_reduce", x)
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (the same shape on all) stacked along dim 0, rank 0 first."""
        if self.size == 1:
            return x
        _count("all_gather", x)
        out = x.new_empty(self.size * x.shape[0], *x.shape[1:])
        dist.all_gather_single(out, x.contiguous(), group=self.group)
        return out

    def all_to_all(self, out: torch.Tensor, x: torch.Tensor, out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None) -> torch.Tensor:
        """Rows ``x`` cut by ``in_splits`` sent to ranks 0, 1, ...; ``out`` receives each
        rank's share for this one (``out_splits`` rows from each), and is returned."""
        _count("all_to_all", x)
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=self.group)
        return out

    def reduce_scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``x``, of which this rank keeps its 1/size of the rows."""
        if self.size == 1:
            return x
        _count("reduce_scatter", x)
        out = x.new_empty(x.shape[0] // self.size, *x.shape[1:])
        dist.reduce_scatter_single(out, x.contiguous(), group=self.group)
        return out

    def slots_per_rank(self, num_experts: int) -> int:
        physical = num_experts + self.num_redundant
        if physical % self.size:
            raise ValueError(f"expert parallel size {self.size} does not divide the physical "
                             f"experts ({num_experts} routed + {self.num_redundant} redundant)")
        return physical // self.size


_EP = ExpertParallel()


def get_ep() -> ExpertParallel:
    return _EP


def set_ep(ep: ExpertParallel) -> None:
    global _EP
    _EP = ep


@contextmanager
def expert_parallel(config) -> Iterator[ExpertParallel]:
    """The expert-parallel state ``config`` (an EngineConfig) asks of this rank, set while
    the model is built (its MoE layers read it then) and kept by the process afterwards
    only when it is a rank of its own; an in-process engine restores what was there."""
    tp, previous = get_tp(), get_ep()
    eplb = config.eplb
    redundant = eplb.num_redundant_experts if eplb is not None else 0
    dp = config.data_parallel
    if dp.size > 1:  # one engine per rank, in one group (init_data_parallel_group)
        ep = ExpertParallel(dp.rank, dp.size, True, redundant, dist.group.WORLD,
                            across_data_parallel=True)
    else:
        ep = ExpertParallel(tp.rank, tp.size, config.enable_expert_parallel, redundant,
                            tp.group)
    set_ep(ep)
    try:
        yield ep
    finally:
        if tp.size == 1 and dp.size == 1:
            set_ep(previous)


def init_data_parallel_group(config) -> None:
    """Join this engine's data-parallel rank to the group of all of them (gloo on CPU,
    NCCL on CUDA), rendezvousing at ``config.data_parallel``'s address and port."""
    dp = config.data_parallel
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{dp.address}:{dp.rpc_port}",
                            rank=dp.rank, world_size=dp.size, timeout=COLLECTIVE_TIMEOUT)
