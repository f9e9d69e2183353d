"""EPLB at run time: count each MoE layer's expert load over a window of steps and, every
``step_interval`` steps, move the experts to the placement openinfer.distributed.eplb picks.

Every rank's worker runs every step (the executor sends each call to all ranks), so the
ranks count steps in lockstep and rearrange at the same step, between two forward passes:
serving pauses for the weight moves only. Each rank sums the layers' load over the
expert-parallel group (under data-parallel attention each rank counts its own tokens),
computes the same placement,
and then, per layer:

* an expert that stays on a rank keeps (or changes) its slot by a local copy;
* an expert new to a rank is sent by the lowest rank that held it (point-to-point sends
  and receives, all posted at once, then awaited).

Load is counted as the running per-expert totals the layers keep anyway
(``FusedExperts.token_counts``) minus a snapshot taken ``window_size`` steps before the
rearrangement: one [E] tensor per layer, not a window of them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from openinfer.config import EPLBConfig
from openinfer.distributed.eplb import Placement, place
from openinfer.distributed.parallel_state import ExpertParallel
from openinfer.layers.moe import FusedExperts

logger = logging.getLogger(__name__)

MIN_GAIN = 0.05
"""A layer is rearranged only when that lowers its max/mean rank load by at least this much
(on the window's load): near-even loads reshuffle under greedy packing, and moving every
replica of a layer for a 1% gain costs more than it saves."""


@dataclass
class BalancerStats:
    rearrangements: int = 0
    experts_moved: int = 0
    """Expert replicas received from another rank, over all layers and rearrangements."""
    bytes_received: int = 0
    seconds: float = 0.0
    """Time spent rearranging (counting, placing, moving), over all rearrangements."""
    last_imbalance: tuple[float, float] = (1.0, 1.0)
    """Max over mean rank load before and after the last rearrangement, in the layer that
    was worst before (for the window's load)."""


class ExpertBalancer:
    def __init__(self, layers: list[FusedExperts], config: EPLBConfig,
                 ep: ExpertParallel, num_groups: int = 1, num_nodes: int = 1) -> None:
        """``num_groups``: the model's expert groups (group-limited routing), and
        ``num_nodes``: the machines the ranks span, for the hierarchical placement."""
        if not layers:
            raise ValueError("enable_eplb: the model has no MoE layers")
        self.layers = layers
        self.config = config
        self.ep = ep
        self.num_groups, self.num_nodes = num_groups, num_nodes
        for layer in layers:
            if layer.token_counts is None:
                layer.count_tokens()
        self.snapshot = [layer.token_counts.clone() for layer in layers]
        self.steps = 0
        self.stats = BalancerStats()

    def step(self) -> None:
        """After every forward pass, on every rank."""
        self.steps += 1
        interval, window = self.config.step_interval, self.config.window_size
        if self.steps % interval == (interval - window) % interval and window < interval:
            self.snapshot = [layer.token_counts.clone() for layer in self.layers]
        if self.steps % interval == 0:
            self.rearrange()

    def rearrange(self) -> None:
        start = time.perf_counter()
        loads = torch.stack([layer.token_counts - snap
                             for layer, snap in zip(self.layers, self.snapshot)])
        self.ep.all_reduce(loads)  # the same totals on every rank
        worst = (0.0, 0.0)
        moved = 0
        for layer, load in zip(self.layers, loads.tolist()):
            if not any(load):
                continue
            placement = place(load, self.ep.size, len(layer.placement.physical_to_logical),
                              layer.placement, self.num_groups, self.num_nodes,
                              self.config.policy)
            before, after = layer.placement.imbalance(load), placement.imbalance(load)
            if before - after < MIN_GAIN:
                after = before  # kept as it is
            elif placement != layer.placement:
                moved += move_experts(layer, placement, self.ep, self.stats)
            if before > worst[0]:
                worst = (before, after)
        self.snapshot = [layer.token_counts.clone() for layer in self.layers]
        self.stats.rearrangements += 1
        self.stats.last_imbalance = worst
        seconds = time.perf_counter() - start
        self.stats.seconds += seconds
        logger.info("EPLB: experts placed again for the last %d steps' load (worst layer: "
                    "max/mean rank load %.2f -> %.2f); %d replicas received in %.0f ms",
                    self.config.window_size, *worst, moved, 1e3 * seconds)


def move_experts(layer: FusedExperts, new: Placement, ep: ExpertParallel,
                 stats: BalancerStats) -> int:
    """Give ``layer`` the weights of ``new`` on this rank; returns the replicas received.
    Every rank calls it for the same layer at the same time (the sends pair up)."""
    old = layer.placement
    tensors = [t for t in (layer.w13, layer.w2, layer.b13, layer.b2) if t is not None]
    source = {}  # expert -> the lowest rank holding it now
    for slot, expert in enumerate(old.physical_to_logical):
        source.setdefault(expert, slot // old.slots_per_rank)
    mine_before = old.rank_experts(ep.rank)
    fresh = [torch.empty_like(t) for t in tensors]
    requests, received = [], 0
    for slot, expert in enumerate(new.rank_experts(ep.rank)):
        if expert in mine_before:
            for t, f in zip(tensors, fresh):
                f[slot].copy_(t[mine_before.index(expert)])
            continue
        for i, f in enumerate(fresh):
            requests.append(dist.irecv(f[slot], src=source[expert], tag=_tag(slot, i, tensors)))
            stats.bytes_received += f[slot].numel() * f.element_size()
        received += 1
    for rank in range(ep.size):
        if rank == ep.rank:
            continue
        theirs_before = old.rank_experts(rank)
        for slot, expert in enumerate(new.rank_experts(rank)):
            if expert not in theirs_before and source[expert] == ep.rank:
                local = mine_before.index(expert)
                for i, t in enumerate(tensors):
                    requests.append(dist.isend(t[local].contiguous(), dst=rank,
                                               tag=_tag(slot, i, tensors)))
    for request in requests:
        request.wait()
    for t, f in zip(tensors, fresh):
        t.data = f
    layer.set_placement(new)
    stats.experts_moved += received
    return received


def _tag(slot: int, tensor: int, tensors: list[torch.Tensor]) -> int:
    """The same on both ends: the receiving slot and which of the layer's tensors."""
    return slot * len(tensors) + tensor
