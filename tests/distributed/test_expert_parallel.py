"""Expert parallelism on CPU: two gloo ranks holding half the experts each give the tokens
and logprobs of one rank, before and after EPLB moves (and replicates) experts between
them as traffic runs; impossible splits are refused at start-up."""

from __future__ import annotations

import re

import pytest
from test_tensor_parallel import _child_processes, _prompts

from openinfer import LLM, SamplingParams
from openinfer.engine.core import EngineCore
from openinfer.engine_args import create_engine_config

# Rearrange every 4 steps for the last 3 steps' load, with two redundant replicas: the
# runs below rearrange several times while requests are in flight.
EPLB = {"window_size": 3, "step_interval": 4, "num_redundant_experts": 2}


@pytest.mark.parametrize("name,eplb", [("qwen3_moe", True), ("deepseek_v3", False)])
def test_experts_split_over_two_ranks_give_the_tokens_of_one(parallel_checkpoints, name, eplb):
    path = str(parallel_checkpoints[name])
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=5, max_tokens=16, ignore_eos=True)]
    options = dict(enable_eplb=True, eplb_config=EPLB) if eplb else {}
    one = LLM(path, progress=False, max_num_batched_tokens=24)
    two = LLM(path, progress=False, max_num_batched_tokens=24, tensor_parallel_size=2,
              enable_expert_parallel=True, **options)
    try:
        prompts = _prompts()
        want = one.generate(prompts, [params[i % 2] for i in range(len(prompts))])
        got = two.generate(prompts, [params[i % 2] for i in range(len(prompts))])
        for w, g in zip(want, got):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            for step_want, step_got in zip(w.outputs[0].logprobs or [], g.outputs[0].logprobs or []):
                for token, lp in step_want.items():
                    assert step_got[token].logprob == pytest.approx(lp.logprob, abs=1e-4)

        executor = two.engine.core.executor
        ranks = executor.collective_rpc("expert_placements")
        layers = ranks[0]["placements"]
        assert layers and all(r["placements"] == layers for r in ranks)  # one view of them
        num_experts = 8
        for slots in layers.values():
            assert sorted(set(slots)) == list(range(num_experts))
            assert len(slots) == num_experts + (2 if eplb else 0)
        # Each rank holds its slots' experts (half of them, plus a replica) and half the rest.
        whole = one.engine.core.executor.worker.weight_bytes()
        assert all(b < 0.7 * whole for b in executor.collective_rpc("weight_bytes"))
        if eplb:
            stats = ranks[0]["eplb"]
            assert stats["rearrangements"] >= 5
            moved = sum(r["eplb"]["experts_moved"] for r in ranks)
            assert moved > 0, "EPLB never moved an expert"
            # The slots were really rearranged: not the order they were loaded in.
            initial = [*range(num_experts), 0, 1]
            assert any(slots != initial for slots in layers.values())
            engine_stats = two.engine.core.stats()
            assert engine_stats["eplb_experts_moved"] == moved
    finally:
        two.engine.core.shutdown()
    assert not _child_processes()


def test_impossible_expert_splits_are_refused_at_start_up(parallel_checkpoints, make_checkpoint):
    moe = str(parallel_checkpoints["qwen3_moe"])
    cases = [
        (moe, dict(tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                   eplb_config={"num_redundant_experts": 1}),
         "expert parallel size 2 (the tensor-parallel ranks) does not divide the physical "
         "experts (8 routed + 1 redundant)"),
        (moe, dict(enable_expert_parallel=True, enable_eplb=True,
                   eplb_config={"num_redundant_experts": 2}),
         "at most 0 with 1 rank(s)"),
        (str(make_checkpoint()), dict(enable_expert_parallel=True), "has no routed experts"),
        (moe, dict(enable_expert_parallel=True, data_parallel_size=2, data_parallel_rpc_port=1,
                   speculative_config={"method": "draft_model", "model": moe,
                                       "num_speculative_tokens": 2}),
         "data-parallel attention with expert parallelism does not run with speculative "
         "decoding with a draft network yet"),
        (moe, dict(enable_expert_parallel=True, data_parallel_size=3, data_parallel_rpc_port=1),
         "expert parallel size 3 (the data-parallel ranks) does not divide the physical "
         "experts (8 routed + 0 redundant)"),
    ]
    for path, options, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            EngineCore(create_engine_config(path, **options))
    config_errors = [
        (dict(data_parallel_size=2, data_parallel_rpc_port=1),
         "data_parallel_size > 1 inside one engine group needs enable_expert_parallel"),
        (dict(enable_expert_parallel=True, data_parallel_size=2),
         "need data_parallel_rpc_port"),
        (dict(enable_expert_parallel=True, data_parallel_size=2, data_parallel_rank=2,
              data_parallel_rpc_port=1), "data_parallel_rank 2 is not a rank of"),
        (dict(enable_expert_parallel=True, data_parallel_size=2, data_parallel_rpc_port=1,
              tensor_parallel_size=2), "with tensor_parallel_size > 1 per rank"),
    ]
    for options, message in config_errors:
        with pytest.raises(ValueError, match=re.escape(message)):
            create_engine_config(moe, **options)
    with pytest.raises(ValueError, match="run as servers that step together"):
        LLM(moe, enable_expert_parallel=True, data_parallel_size=2, data_parallel_rpc_port=1)
    assert not _child_processes(), "a refused start left a process behind"
