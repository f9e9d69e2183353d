"""The data-parallel expert exchange, layer by layer: two gloo ranks with different numbers
of tokens (none, for one of them, in some rounds) each get, through the all-gather /
reduce-scatter path and through the all-to-all path, the outputs one process holding every
expert computes for their tokens; with redundant replicas, in a rebalanced placement."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

from openinfer.distributed.eplb import rebalance
from openinfer.layers import moe
from openinfer.layers.moe import FusedExperts

EXPERTS, HIDDEN, INTER, TOP_K = 8, 16, 24, 3
ROUNDS = [(5, 0), (0, 7), (37, 12), (1, 1), (64, 3)]
"""Tokens of rank 0 and rank 1 in each round."""


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.2,
            torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.2)


def _tokens(round_: int, rank: int, n: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(100 * round_ + rank)
    x = torch.randn(n, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(n)]) \
        if n else torch.empty(0, TOP_K, dtype=torch.long)
    weights = torch.rand(n, TOP_K, generator=g)
    return x, weights, ids


def _rank(rank: int, port: int, min_tokens: int, results) -> None:
    import torch.distributed as dist

    from openinfer.distributed.parallel_state import ExpertParallel, set_ep

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    set_ep(ExpertParallel(rank, 2, True, 2, dist.group.WORLD, across_data_parallel=True))
    moe.ALL_TO_ALL_MIN_TOKENS = {"cpu": min_tokens}
    layer = FusedExperts(EXPERTS, HIDDEN, INTER)
    load = [50, 1, 1, 30, 2, 2, 9, 5]  # experts 0 and 3 hot: replicated
    layer.set_placement(rebalance(load, 2, EXPERTS + 2, layer.placement))
    w13, w2 = _weights()
    for slot, expert in enumerate(layer.placement.rank_experts(rank)):
        layer.w13.data[slot], layer.w2.data[slot] = w13[expert], w2[expert]
    outs = []
    for i, counts in enumerate(ROUNDS):
        x, weights, ids = _tokens(i, rank, counts[rank])
        outs.append(layer(x, weights, ids).tolist())  # (tensors would go as shared memory)
    results.put((rank, outs))
    # Both ranks past their last collective before either tears gloo down: a rank leaving
    # while its peer's gloo thread still held the pair aborted the peer once (exit code -6,
    # "terminate called without an active exception") after the results were in.
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("path,min_tokens", [("all-gather", 10**9), ("all-to-all", 0)])
def test_each_rank_gets_the_outputs_of_all_experts_for_its_tokens(path, min_tokens):
    reference = FusedExperts(EXPERTS, HIDDEN, INTER)
    reference.w13.data, reference.w2.data = _weights()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, min_tokens, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for i, counts in enumerate(ROUNDS):
        for rank in range(2):
            want = reference(*_tokens(i, rank, counts[rank]))
            torch.testing.assert_close(torch.tensor(got[rank][i]).view_as(want), want, rtol=1e-5, atol=1e-5)
