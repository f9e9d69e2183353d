"""Prefill context parallelism on CPU: two gloo ranks split long prompt chunks zig-zag
(each attends for its two pieces, the K/V exchanged per layer) and give the tokens,
logprobs and prompt logprobs of one rank, for dense and mixture-of-experts models; what
it cannot run is refused at start-up."""

from __future__ import annotations

import re

import pytest
from test_tensor_parallel import _child_processes, _prompts

from openinfer import LLM, SamplingParams
from openinfer.distributed.context_parallel import ContextParallel, plan_step
from openinfer.engine.core import EngineCore
from openinfer.engine_args import create_engine_config


def test_the_pieces_cover_a_chunk_once_and_balance_causal_work():
    cp = [ContextParallel(rank, 2) for rank in range(2)]
    pieces = sorted(p for c in cp for p in c.pieces(37, c.rank))
    assert pieces == [(0, 9), (9, 18), (18, 27), (27, 37)]
    # Rank 0 takes the first and last pieces, rank 1 the middle two.
    assert cp[0].pieces(37, 0) == [(0, 9), (27, 37)] and cp[1].pieces(37, 1) == [(9, 18), (18, 27)]
    # A decode and a short chunk stay whole; a long chunk after 20 cached tokens is split.
    step, q, s, tables = plan_step(cp[1], [1, 5, 40], [7, 5, 60], [[3], [4], [5, 6, 7, 8]], 16)
    assert q == [1, 5, 10, 10] and s == [7, 5, 40, 50]
    assert step.local_rows.tolist() == [0, 1, 2, 3, 4, 5, *range(16, 26), *range(26, 36)]
    assert step.split_rows[0].tolist() == [*range(6, 16), *range(36, 46)]
    # Rank 0's split tokens sit at positions 20..29 and 50..59 of the third sequence.
    slots = [[5, 6, 7, 8][p // 16] * 16 + p % 16 for p in [*range(20, 30), *range(50, 60)]]
    assert step.other_slots.tolist() == slots


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_two_ranks_split_prompts_and_give_the_outputs_of_one(parallel_checkpoints, name):
    path = str(parallel_checkpoints[name])
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2,
                             prompt_logprobs=1),
              SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)]
    one = LLM(path, progress=False, max_num_batched_tokens=48)
    two = LLM(path, progress=False, max_num_batched_tokens=48, prefill_context_parallel_size=2)
    try:
        prompts = _prompts()
        chosen = [params[(i + 1) % 2] for i in range(len(prompts))]  # the long ones greedy
        for want, got in zip(one.generate(prompts, chosen), two.generate(prompts, chosen)):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            for step_want, step_got in zip(want.outputs[0].logprobs or [],
                                           got.outputs[0].logprobs or []):
                for token, lp in step_want.items():
                    assert step_got[token].logprob == pytest.approx(lp.logprob, abs=1e-4)
            for pos_want, pos_got in zip(want.prompt_logprobs or [], got.prompt_logprobs or []):
                for token, lp in (pos_want or {}).items():
                    assert pos_got[token].logprob == pytest.approx(lp.logprob, abs=1e-4)
        stats = two.engine.core.executor.collective_rpc("collective_stats")
        assert all(s["all_gather"][0] > 0 for s in stats), "no chunk was split"
    finally:
        two.engine.core.shutdown()
    assert not _child_processes()


def test_what_context_parallelism_cannot_run_is_refused(parallel_checkpoints, make_checkpoint):
    llama = str(parallel_checkpoints["llama"])
    cases = [
        (llama, dict(prefill_context_parallel_size=2, tensor_parallel_size=2),
         "with tensor_parallel_size > 1 is not supported yet"),
        (llama, dict(prefill_context_parallel_size=2, speculative_config={
            "method": "draft_model", "model": llama, "num_speculative_tokens": 2}),
         "does not run with speculative decoding with a draft network yet"),
        (str(make_checkpoint("Gemma2ForCausalLM")), dict(prefill_context_parallel_size=2),
         "Gemma2ForCausalLM cannot be split by context yet"),
    ]
    for path, options, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            EngineCore(create_engine_config(path, **options))
    assert not _child_processes()


def test_two_ranks_keep_the_kv_tiers_of_one(parallel_checkpoints, tmp_path):
    """--kv-host-memory and --kv-store-dir under context parallelism: every rank holds the
    whole blocks (in its host pool), the first rank writes them to the store once, and after
    the device and host tiers forget them both ranks read them back from those files, with
    one rank's tokens."""
    path, store = str(parallel_checkpoints["llama"]), tmp_path / "store"
    prompts = [[(5 * i + j) % 900 + 3 for j in range(70)] for i in range(2)]  # chunks split
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(
        path, progress=False, enable_prefix_caching=False).generate(prompts, greedy)]
    two = LLM(path, progress=False, max_num_batched_tokens=48, prefill_context_parallel_size=2,
              kv_host_memory=2 * 2**20, kv_store_dir=str(store))
    core = two.engine.core
    try:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, greedy)] == expected
        core.connector.drain_file_io()
        assert len(list(store.rglob("*.kvblock"))) == 2 * 4  # once, not once per rank
        core.reset_prefix_cache()
        again = two.generate(prompts, greedy)
        assert [o.outputs[0].token_ids for o in again] == expected
        assert [o.num_cached_tokens for o in again] == [64, 64]
        assert core.kv.hit_tokens_by_tier["L3"] == 2 * 64
        core.check_integrity()
    finally:
        core.shutdown()


def test_two_ranks_verify_ngram_drafts_as_one(parallel_checkpoints):
    """N-gram drafts under context parallelism: long prompt chunks are split, the short
    verification steps run whole on every rank, and the greedy tokens are one rank's."""
    path = str(parallel_checkpoints["llama"])
    prompts = [[5, 6, 7, 8] * 15, [40, 41, 42] * 17]  # long enough to split, repeating
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [o.outputs[0].token_ids
                for o in LLM(path, progress=False).generate(prompts, greedy)]
    two = LLM(path, progress=False, max_num_batched_tokens=48, prefill_context_parallel_size=2,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, greedy)] == expected
        assert two.engine.core.stats()["spec_num_draft_tokens"] > 0
        stats = two.engine.core.executor.collective_rpc("collective_stats")
        assert all(s["all_gather"][0] > 0 for s in stats), "no chunk was split"
    finally:
        two.engine.core.shutdown()
