"""EPLB's placement (pure Python): a skewed load is balanced over the ranks, hot experts get
the redundant replicas, an expert that stays on its rank keeps its slot; and the settings
are checked by name."""

from __future__ import annotations

import random

import pytest

from openinfer.config import EPLBConfig
from openinfer.distributed.eplb import (
    Placement,
    initial_placement,
    place,
    rebalance,
    rebalance_hierarchical,
    replicate,
)
from openinfer.engine_args import create_engine_config


def _skewed_load(num_experts: int, seed: int = 0) -> list[int]:
    """Tokens per expert of a Zipf-like trace: a few experts take most of them."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** 1.2 for rank in range(num_experts)]
    rng.shuffle(weights)
    trace = rng.choices(range(num_experts), weights=weights, k=20_000)
    return [trace.count(e) for e in range(num_experts)]


def _check_valid(placement: Placement, num_experts: int, num_ranks: int, per_rank: int) -> None:
    assert len(placement.physical_to_logical) == num_ranks * per_rank
    assert placement.slots_per_rank == per_rank
    assert sorted(set(placement.physical_to_logical)) == list(range(num_experts))


@pytest.mark.parametrize("num_experts,num_ranks,redundant", [(64, 8, 0), (64, 8, 8), (16, 2, 2)])
def test_a_skewed_load_gets_balanced(num_experts, num_ranks, redundant):
    load = _skewed_load(num_experts)
    start = initial_placement(num_experts, num_ranks, redundant)
    placed = rebalance(load, num_ranks, num_experts + redundant, start)
    _check_valid(placed, num_experts, num_ranks, (num_experts + redundant) // num_ranks)
    before, after = start.imbalance(load), placed.imbalance(load)
    # No placement beats the heaviest replica on a rank of its own.
    copies = [len(r) for r in placed.replicas()]
    mean = sum(load) / num_ranks
    bound = max(1.0, max(w / c for w, c in zip(load, copies)) / mean)
    assert before > 1.1
    assert after <= 1.05 * bound and after < before - 0.5 * (before - bound)
    # A rank never holds two replicas of one expert.
    for rank in range(num_ranks):
        experts = placed.rank_experts(rank)
        assert len(set(experts)) == len(experts)


def test_redundant_slots_go_to_the_hottest_experts():
    load = [100, 10, 10, 10, 400, 10]
    assert replicate(load, 9, 3) == [2, 1, 1, 1, 3, 1]
    assert replicate(load, 9, 2) == [2, 2, 1, 1, 2, 1]  # never more replicas than ranks
    placed = rebalance(load, 3, 9)
    assert [len(r) for r in placed.replicas()] == [2, 1, 1, 1, 3, 1]
    # Three slots a rank: {4, 0, small} twice and {4, small, small} is the best there is.
    assert placed.imbalance(load) == pytest.approx((400 / 3 + 50 + 10) / 180)


def test_experts_that_stay_on_their_rank_keep_their_slots():
    load = _skewed_load(16, seed=3)
    first = rebalance(load, 4, 20, initial_placement(16, 4, 4))
    assert rebalance(load, 4, 20, first) == first  # nothing moves on the same load
    shifted = rebalance(load[::-1], 4, 20, first)
    for rank in range(4):
        before, after = first.rank_experts(rank), shifted.rank_experts(rank)
        for slot, expert in enumerate(after):
            if expert in before and before.count(expert) == 1 and after.count(expert) == 1:
                assert before[slot] == expert


def test_a_near_even_change_of_load_moves_few_experts():
    """Packing prefers the ranks that hold an expert already: on the same skew with a few
    percent of noise, far fewer replicas move than plain greedy packing moves, for at most
    the allowed slack of balance."""
    load = _skewed_load(64)
    rng = random.Random(1)
    noisy = [w * (1 + rng.uniform(-0.05, 0.05)) for w in load]

    def moved(stickiness: float) -> tuple[int, float]:
        first = rebalance(load, 8, 72, initial_placement(64, 8, 8), stickiness=stickiness)
        second = rebalance(noisy, 8, 72, first, stickiness=stickiness)
        new = sum(len(set(second.rank_experts(r)) - set(first.rank_experts(r)))
                  for r in range(8))
        return new, second.imbalance(noisy)

    (greedy_moves, greedy_balance), (sticky_moves, sticky_balance) = moved(0.0), moved(0.02)
    assert sticky_moves * 2 <= greedy_moves
    assert sticky_balance <= greedy_balance + 0.02


def test_hierarchical_placement_keeps_each_group_on_one_node_and_balances():
    """DeepSeek's hierarchical policy: 64 experts in 8 groups on 2 nodes of 4 ranks, 16
    redundant slots. Every replica of an expert lies on its group's node, each node holds 4
    whole groups, and the skewed load is still balanced (less well than the global policy,
    which may spread a group over both nodes)."""
    load = _skewed_load(64, seed=5)
    start = initial_placement(64, 8, 16)
    placed = rebalance_hierarchical(load, 8, 80, num_groups=8, num_nodes=2, current=start)
    _check_valid(placed, 64, 8, 10)
    node_of = [{slot // 40 for slot in replicas} for replicas in placed.replicas()]
    assert all(len(nodes) == 1 for nodes in node_of)  # an expert's replicas: one node
    for group in range(8):  # a group's experts: one node
        assert len({next(iter(node_of[e])) for e in range(group * 8, group * 8 + 8)}) == 1
    assert [sum(1 for g in range(8) if node_of[g * 8] == {n}) for n in (0, 1)] == [4, 4]
    overall = place(load, 8, 80, start)  # one node: the global policy
    assert overall == rebalance(load, 8, 80, start)
    assert start.imbalance(load) > placed.imbalance(load) >= overall.imbalance(load)
    assert placed.imbalance(load) < 1.15
    # The same load again moves nothing; place() takes this policy where the nodes fit.
    assert rebalance_hierarchical(load, 8, 80, 8, 2, placed) == placed
    assert place(load, 8, 80, placed, num_groups=8, num_nodes=2) == placed
    # Where they do not (3 nodes for 8 groups), the global policy.
    assert place(load, 6, 78, None, num_groups=8, num_nodes=3) == rebalance(load, 6, 78)
    # eplb_config.policy "global" keeps the global policy where the nodes would fit.
    assert place(load, 8, 80, start, 8, 2, policy="global") == overall


def test_a_hierarchical_policy_that_cannot_apply_is_refused(parallel_checkpoints):
    from openinfer.engine.core import EngineCore

    with pytest.raises(ValueError, match="policy must be auto, global or hierarchical"):
        EPLBConfig.parse({"policy": "nodes"})
    moe = str(parallel_checkpoints["qwen3_moe"])  # one node, no expert groups
    with pytest.raises(ValueError, match=r"policy hierarchical needs ranks on several nodes "
                                         r"\(--nnodes; here 1\)"):
        EngineCore(create_engine_config(moe, tensor_parallel_size=2, enable_expert_parallel=True,
                                       enable_eplb=True, eplb_config={"policy": "hierarchical"}))


def test_impossible_placements_and_bad_settings_are_refused(make_checkpoint):
    with pytest.raises(ValueError, match="3 ranks do not divide 8 experts"):
        initial_placement(8, 3)
    with pytest.raises(ValueError, match="cannot hold 8 experts"):
        rebalance([1] * 8, 2, 6)
    with pytest.raises(ValueError, match="more than 2 replicas"):
        rebalance([1] * 4, 2, 10)
    with pytest.raises(ValueError, match=r"window_size \(10\) <= step_interval \(5\)"):
        EPLBConfig(window_size=10, step_interval=5)
    with pytest.raises(ValueError, match="unknown field.*window"):
        EPLBConfig.parse('{"window": 3}')
    with pytest.raises(ValueError, match="num_redundant_experts must be a non-negative"):
        EPLBConfig.parse({"num_redundant_experts": -1})
    path = str(make_checkpoint())
    with pytest.raises(ValueError, match="enable_eplb needs enable_expert_parallel"):
        create_engine_config(path, enable_eplb=True)
    with pytest.raises(ValueError, match="eplb_config is given but enable_eplb is not"):
        create_engine_config(path, enable_expert_parallel=True, eplb_config={"window_size": 2})
