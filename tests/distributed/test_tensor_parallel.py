"""Tensor parallelism on CPU: two gloo ranks (worker processes) give the tokens and
logprobs of one rank (dense and mixture-of-experts models), hold half the weights and KV
heads each, refuse what they cannot run at start-up, and fail at once (leaving no process)
when a rank dies."""

from __future__ import annotations

import re
import time

import psutil
import pytest
import torch
from conftest import CHECKPOINTS, fp8_checkpoint

from openinfer import LLM, SamplingParams
from openinfer.engine.core import EngineCore
from openinfer.engine.scheduler import Scheduler
from openinfer.engine_args import create_engine_config
from openinfer.executor.multiproc import RankFailed
from openinfer.transfer.file_store import (
    PROBE_PREFIX,
    RankStore,
    StoreMembership,
    model_fingerprint,
)


def _child_processes() -> list[psutil.Process]:
    """This process's children but multiprocessing's resource tracker (it outlives them)."""
    return [p for p in psutil.Process().children()
            if "resource_tracker" not in " ".join(p.cmdline())]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 37, 12, 60)]


def _run(llm: LLM, params: list[SamplingParams]):
    outs = llm.generate(_prompts(), params)
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_two_ranks_give_the_tokens_and_logprobs_of_one(parallel_checkpoints, name):
    path = str(parallel_checkpoints[name])
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.9, seed=4, max_tokens=12, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.7, top_k=30, seed=9, max_tokens=14, ignore_eos=True,
                             logprobs=1)]
    # A small step budget chunks the prompts, so prefills and decodes share steps.
    one = LLM(path, progress=False, max_num_batched_tokens=24)
    two = LLM(path, progress=False, max_num_batched_tokens=24, tensor_parallel_size=2)
    try:
        expected, got = _run(one, params), _run(two, params)
        for want, out in zip(expected, got):
            assert out.token_ids == want.token_ids
            for step_want, step_got in zip(want.logprobs, out.logprobs):
                assert step_got.keys() == step_want.keys()
                for token, lp in step_want.items():
                    assert step_got[token].logprob == pytest.approx(lp.logprob, abs=1e-4)
        # Unseeded sampling draws the same on both ranks (or they would disagree on the
        # next step's inputs and the run would fail or diverge from its own greedy prefix).
        free = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
        assert all(len(o.token_ids) == 8 for o in _run(two, [free] * 4))

        # Each rank holds about half of every sharded weight and its share of the KV heads.
        executor = two.engine.core.executor
        whole = one.engine.core.executor.worker.weight_bytes()
        per_rank = executor.collective_rpc("weight_bytes")
        # (V4's one KV head, compressors, indexer and hyper-connections are whole on each)
        most = 0.65 if name == "deepseek_v4" else 0.6
        assert len(per_rank) == 2 and all(0.45 * whole < b < most * whole for b in per_rank)
        specs = executor.call("kv_cache_specs")
        if name == "deepseek_v4":  # every slot whole on every rank
            assert specs == one.engine.core.executor.call("kv_cache_specs")
        elif name == "deepseek_v3":  # one latent entry per token, whole on every rank
            assert {(spec.latent_dim, spec.rope_dim) for spec in specs} == {(32, 16)}
        else:  # of 1 (replicated) or 2 (split) KV heads in the checkpoint
            assert {spec.num_kv_heads for spec in specs} == {1}
    finally:
        two.engine.core.shutdown()
    assert not two.engine.core.executor.alive


def test_two_ranks_hold_their_slices_of_fp8_weights_and_answer_as_one(parallel_checkpoints,
                                                                       tmp_path):
    """DeepSeek-V3 in its FP8 release format over two ranks: each rank's linear layers keep
    their rows (or columns) of the fp8 bytes and the scales of those tiles, and the greedy
    tokens are one rank's."""
    path = str(fp8_checkpoint(parallel_checkpoints["deepseek_v3"], tmp_path / "fp8", 16))
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * 4
    one = LLM(path, progress=False, max_num_batched_tokens=24)
    two = LLM(path, progress=False, max_num_batched_tokens=24, tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in _run(two, params)] == [o.token_ids for o in _run(one, params)]
        assert one.engine.core.compute_info["gemm"].endswith("+fp8")
        assert two.engine.core.compute_info["gemm"].endswith("+fp8")
        # each rank's experts too: its 16 of 32 features start on a 16x16 tile
        assert [r["experts"] for r in two.engine.core.executor.collective_rpc("compute_info_labels")] \
            == ["cpu+fp8"] * 2
        # fp8 rows and columns split over the ranks: under 0.6 of one rank's bytes each
        whole = one.engine.core.executor.worker.weight_bytes()
        per_rank = two.engine.core.executor.collective_rpc("weight_bytes")
        assert all(0.45 * whole < b < 0.6 * whole for b in per_rank), (whole, per_rank)
    finally:
        two.engine.core.shutdown()


def test_a_store_the_engine_core_does_not_see_is_refused(tmp_path):
    """Ranks on other machines write their files where they mount --kv-store-dir; the engine
    core tests them from its own machine, so each rank's start-up probe must be visible
    there (a shared mount). Rank 1's probe missing: refused, naming the rank. Two ranks in
    one directory (context parallelism) each find their own."""
    dirs = [tmp_path / "rank0", tmp_path / "rank1"]
    for d in dirs:
        d.mkdir()
    (dirs[0] / f"{PROBE_PREFIX}a").write_text("node0")
    stores = [RankStore(dirs[0], f"{PROBE_PREFIX}a"), RankStore(dirs[1], f"{PROBE_PREFIX}b")]
    with pytest.raises(ValueError, match=r"rank 1 keeps its blocks in .*rank1, which the engine "
                                         r"core's machine does not see.*\(3FS, NFS\)"):
        StoreMembership.of_ranks(stores)
    (dirs[1] / f"{PROBE_PREFIX}b").write_text("node1")
    (dirs[0] / f"{PROBE_PREFIX}c").write_text("node0, another rank")
    shared = stores + [RankStore(dirs[0], f"{PROBE_PREFIX}c")]
    assert StoreMembership.of_ranks(shared).directories == [dirs[0], dirs[1], dirs[0]]
    assert not list(tmp_path.rglob(f"{PROBE_PREFIX}*")), "the probes stay behind"


def test_impossible_splits_are_refused_at_start_up(make_checkpoint):
    odd_heads, fine = make_checkpoint(num_heads=3, num_kv_heads=1), make_checkpoint()
    cases = [
        (odd_heads, dict(tensor_parallel_size=2),
         "tensor_parallel_size 2 does not divide num_attention_heads (3)"),
        (fine, dict(tensor_parallel_size=(psutil.cpu_count() or 1) * 4),
         "more than CPU cores"),
        (fine, dict(tensor_parallel_size=2, nnodes=3), "2 ranks do not split evenly over nnodes 3"),
        (fine, dict(tensor_parallel_size=2, distributed_executor_backend="ray", kv_role="prefill"),
         "does not run with disaggregation (--role / --kv-transfer-port)"),
        (fine, dict(tensor_parallel_size=2, speculative_config={
            "method": "draft_model", "model": str(odd_heads), "num_speculative_tokens": 2}),
         "tensor_parallel_size 2 does not divide the draft model's num_attention_heads (3)"),
        (fine, dict(tensor_parallel_size=2, nnodes=2, distributed_executor_backend="ray"),
         "the ray backend places ranks on its cluster's nodes itself"),
    ]
    for path, options, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            EngineCore(create_engine_config(str(path), **options))
    assert not _child_processes(), "a refused start left a process behind"


def test_two_ranks_pipeline_steps_under_asynchronous_scheduling(parallel_checkpoints,
                                                                monkeypatch):
    """The core sends step N+1 to the ranks before reading step N's answers: the tokens of
    synchronous steps, a call between steps reads the answers first, and a rank that dies
    with steps in flight still fails the engine at once."""
    path = str(parallel_checkpoints["llama"])
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=4, max_tokens=12, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=30, seed=9, max_tokens=14, ignore_eos=True)]
    expected = _run(LLM(path, progress=False, max_num_batched_tokens=24), params)
    overlapped = []
    schedule = Scheduler.schedule

    def counting(scheduler, in_flight=None):
        overlapped.append(in_flight is not None and not in_flight.is_empty)
        return schedule(scheduler, in_flight)

    monkeypatch.setattr(Scheduler, "schedule", counting)
    two = LLM(path, progress=False, max_num_batched_tokens=24, tensor_parallel_size=2,
              async_scheduling=True)
    core = two.engine.core
    try:
        got = _run(two, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        for step_got, step_want in zip(got[1].logprobs, expected[1].logprobs):
            assert step_got.keys() == step_want.keys()
            assert all(step_got[t].logprob == pytest.approx(step_want[t].logprob, abs=1e-4)
                       for t in step_want)
        assert sum(overlapped) > 10, "no step was sent while the one before computed"
        for i, prompt in enumerate(_prompts()):
            core.add_request(f"r{i}", prompt, params[0])
        for _ in range(4):
            core.step()
        assert core._in_flight is not None and core.executor._pending
        assert len(core.executor.collective_rpc("weight_bytes")) == 2  # reads the step first
        assert not core.executor._pending and core._in_flight[1].done()
        _kill_rank_1_and_step(core)
    finally:
        if core.executor.alive:
            core.shutdown()
    assert not _child_processes()


def test_a_dead_rank_fails_the_engine_at_once_and_leaves_no_process(parallel_checkpoints):
    core = EngineCore(create_engine_config(str(parallel_checkpoints["qwen3_moe"]), tensor_parallel_size=2))
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i, prompt in enumerate(_prompts()):
        core.add_request(f"r{i}", prompt, params)
    for _ in range(3):
        core.step()
    _kill_rank_1_and_step(core)
    assert not _child_processes()


def _kill_rank_1_and_step(core: EngineCore) -> None:
    """Kill rank 1 mid-run: the next steps fail the engine within 30 s, every rank gone."""
    ranks = list(core.executor._procs)
    ranks[1].kill()
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 died"):
        while True:
            core.step()
    assert time.monotonic() - start < 30
    assert not any(p.is_alive() for p in ranks)


def test_two_ranks_keep_their_kv_shares_in_host_memory_and_files(parallel_checkpoints, tmp_path):
    """--kv-host-memory and --kv-store-dir under tensor parallelism: each rank keeps its
    KV heads' share of a block in its own host pool and its own files; a block counts as
    stored when both ranks' files are there, and comes back from them with the plain path's
    tokens. Neither a single-rank engine nor the other rank reads a rank's files."""
    path, store = str(parallel_checkpoints["qwen3_moe"]), tmp_path / "store"
    prompts = _prompts()[1:] + [[9, 8, 7] * 12]  # 37, 12, 60 and 36 tokens
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = LLM(path, progress=False, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    full_blocks = sum(len(p) // 16 for p in prompts)  # of the prompts: 2 + 0 + 3 + 2
    written = sum((len(p) + 5) // 16 for p in prompts)  # with the generated tokens' KV: 9
    two = LLM(path, progress=False, tensor_parallel_size=2, kv_host_memory=2 * 2**20,
              kv_store_dir=str(store))
    core = two.engine.core
    try:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, greedy)] == expected
        core.connector.drain_file_io()
        shards = sorted(d for d in store.iterdir() if d.is_dir())
        # One directory per rank, each with every block; neither is the one a single-rank
        # engine reads (a share is not a whole block).
        assert len(shards) == 2 and model_fingerprint(path)[:16] not in {d.name for d in shards}
        assert [len(list(d.rglob("*.kvblock"))) for d in shards] == [written] * 2
        # Forget L1 and L2: the blocks come back from both ranks' files.
        core.reset_prefix_cache()
        again = two.generate(prompts, greedy)
        assert [o.outputs[0].token_ids for o in again] == expected
        assert [o.num_cached_tokens for o in again] == [16 * (len(p) // 16) for p in prompts]
        assert core.kv.hit_tokens_by_tier["L3"] == 16 * full_blocks
        io = core.stats()
        assert io["kv_transfer_bytes"]["store_to_host"] > 0  # (both ranks' bytes)
        # One rank's file gone: that block is not in the store any more (nor are the ones
        # after it in its prompt), so it is computed again, with the same tokens.
        first = next(iter(sorted(shards[1].rglob("*.kvblock"))))
        first.unlink()
        core.reset_prefix_cache()
        third = two.generate(prompts, greedy)
        assert [o.outputs[0].token_ids for o in third] == expected
        assert sum(o.num_cached_tokens for o in third) < 16 * full_blocks
        core.check_integrity()
    finally:
        core.shutdown()


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_two_ranks_verify_token_drafts_as_one(parallel_checkpoints, method):
    """N-gram and suffix drafting under tensor parallelism: every rank drafts alike from the
    same tokens, verifies alike, and the greedy tokens are the plain single-rank ones."""
    path = str(parallel_checkpoints["qwen3_moe"])
    prompts = [[5, 6, 7, 8] * 6, [40, 41, 42] * 7 + [43]]  # repeats to draft from
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(path, progress=False)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    two = LLM(path, progress=False, tensor_parallel_size=2,
              speculative_config={"method": method, "num_speculative_tokens": 3})
    try:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, greedy)] == expected
        stats = two.engine.core.stats()
        assert stats["spec_num_draft_tokens"] > 0
    finally:
        two.engine.core.shutdown()


def test_two_rank_instances_disaggregate_rank_to_rank(parallel_checkpoints):
    """A TP=2 prefill instance and a TP=2 decode instance: each prefill rank lends its
    share of the blocks on its own port (remote_rank_ports), each decode rank pulls its
    share from the same rank, and the tokens are colocated serving's; the leases end on
    both prefill ranks. A single-rank decode instance cannot take the shares for whole
    blocks: its pull is refused by the layout check and it recomputes, with the same tokens."""
    path = str(parallel_checkpoints["qwen3_moe"])
    prompts = [[(7 * i + j) % 900 + 3 for j in range(40)] for i in range(3)]  # 2 full blocks
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = LLM(path, progress=False, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    prefill = LLM(path, progress=False, tensor_parallel_size=2, kv_role="prefill")
    decode = LLM(path, progress=False, tensor_parallel_size=2, kv_role="decode")
    single = LLM(path, progress=False, kv_role="decode")
    try:
        lent = prefill.generate(prompts, SamplingParams(
            temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
        params = [o.kv_transfer_params for o in lent]
        assert all(len(p["remote_rank_ports"]) == 2 and p["remote_rank_ports"][0] ==
                   p["remote_port"] and len(p["remote_block_hashes"]) == 2 for p in params)
        outs = decode.generate(prompts, [SamplingParams(**vars_of(greedy),
                                                        kv_transfer_params=p) for p in params])
        assert [o.outputs[0].token_ids for o in outs] == expected
        core = decode.engine.core
        assert core.scheduler.num_remote_blocks_pulled == 3 * 2
        assert core.scheduler.num_prompt_tokens_computed == 3 * 8  # only the tails
        assert core.stats()["kv_remote_pull_failures"] == 0
        _wait_leases_ended(prefill)

        # The shares are not whole blocks: a single-rank decode instance is refused them.
        lent = prefill.generate(prompts[:1], SamplingParams(
            temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
        out = single.generate(prompts[:1], SamplingParams(
            **vars_of(greedy), kv_transfer_params=lent[0].kv_transfer_params))[0]
        assert out.outputs[0].token_ids == expected[0]
        assert single.engine.core.scheduler.num_remote_blocks_pulled == 0
        assert single.engine.core.stats()["kv_remote_pull_failures"] == 1
        _wait_leases_ended(prefill)  # (released by the refused puller)
    finally:
        for llm in (prefill, decode, single):
            llm.engine.core.shutdown()


def vars_of(params: SamplingParams) -> dict:
    return dict(temperature=params.temperature, max_tokens=params.max_tokens,
                ignore_eos=params.ignore_eos)


def _wait_leases_ended(prefill: LLM, timeout_s: float = 10.0) -> None:
    """Until the prefill instance holds no leased block (its ranks' leases all ended)."""
    core = prefill.engine.core
    deadline = time.monotonic() + timeout_s
    while core.kv.num_held or core.stats()["kv_leases"]:
        assert time.monotonic() < deadline, (core.kv.num_held, core.stats()["kv_leases"])
        time.sleep(0.05)
        core.connector.collect_leases()


def test_two_ranks_run_a_draft_model_split_like_the_target(parallel_checkpoints):
    """method draft_model under TP=2: the draft is split over the ranks like the target
    (its own share of heads, its own KV share). The target as its own draft: every draft is
    accepted, so the split draft computes what the whole one would; the tokens are plain."""
    path = str(parallel_checkpoints["qwen3_moe"])
    prompts = [[5, 6, 7, 8] * 6, [40, 41, 42] * 7 + [43]]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [o.outputs[0].token_ids
                for o in LLM(path, progress=False).generate(prompts, greedy)]
    two = LLM(path, progress=False, tensor_parallel_size=2, speculative_config={
        "method": "draft_model", "model": path, "num_speculative_tokens": 3})
    try:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, greedy)] == expected
        stats = two.engine.core.stats()
        assert stats["spec_num_draft_tokens"] > 0
        assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]
    finally:
        two.engine.core.shutdown()
