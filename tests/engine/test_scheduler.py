"""Scheduler behaviour over integers only: budgets, chunking, preemption, fairness."""

from __future__ import annotations

from openinfer.config import SchedulerConfig
from openinfer.engine.outputs import ModelRunnerOutput, SchedulerOutput
from openinfer.engine.request import Request, RequestStatus
from openinfer.engine.scheduler import Scheduler
from openinfer.kv.block_hash import extend_block_hashes
from openinfer.kv.host_cache import HostCacheIndex
from openinfer.kv.kv_manager import KVCacheManager
from openinfer.kv.spec import FullAttentionSpec, group_layers
from openinfer.sampling_params import SamplingParams

BLOCK = 4


def _scheduler(num_blocks: int = 64, budget: int = 64, max_seqs: int = 16,
               policy: str = "fcfs", caching: bool = False, chunked: bool = True) -> Scheduler:
    """Prefix caching is off unless asked for: these prompts all share prefixes."""
    spec = FullAttentionSpec(BLOCK, 1, 8, "float32")
    kv = KVCacheManager(group_layers([spec]), num_blocks, enable_caching=caching)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                     policy=policy, enable_chunked_prefill=chunked), kv)


def _request(rid: str, prompt_len: int, max_tokens: int = 4, arrival: float = 0.0,
             priority: int = 0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, priority=priority, ignore_eos=True)
    return Request(rid, list(range(1, prompt_len + 1)), params, max_tokens, arrival_time=arrival)


class FakeRunner:
    """Mirrors what the model runner tracks: samples token 7 when a request's tokens are done."""

    def __init__(self) -> None:
        self.known: dict[str, list[int]] = {}  # request -> [num_tokens, num_computed]

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_request_ids:
            self.known.pop(rid)
        for new in out.new_requests:
            assert new.request_id not in self.known
            self.known[new.request_id] = [len(new.prompt_token_ids) + len(new.output_token_ids),
                                          new.num_computed_tokens]
        for cached in out.cached_requests:
            assert self.known[cached.request_id][1] == cached.num_computed_tokens
        result = ModelRunnerOutput()
        for rid, n in out.num_scheduled_tokens.items():
            state = self.known[rid]
            state[1] += n
            assert state[1] <= state[0]
            if state[1] == state[0]:
                result.sampled_token_ids[rid] = [7]
                state[0] += 1
        return result


def _run(s: Scheduler, steps: int = 1000) -> list[SchedulerOutput]:
    runner, outs = FakeRunner(), []
    for _ in range(steps):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        s.update_from_output(out, runner.execute(out))
        s.check_integrity()
        outs.append(out)
    assert not s.has_unfinished_requests(), "requests left unfinished"
    return outs


def test_decodes_and_prefills_share_the_token_budget():
    s = _scheduler(budget=10)
    s.add_request(_request("a", 6))
    first = s.schedule()
    assert first.num_scheduled_tokens == {"a": 6}
    s.update_from_output(first, ModelRunnerOutput(sampled_token_ids={"a": [7]}))
    s.add_request(_request("b", 20))
    second = s.schedule()
    # a decodes (1 token); b's prompt is chunked into the remaining 9.
    assert second.num_scheduled_tokens == {"a": 1, "b": 9}
    assert [r.request_id for r in second.cached_requests] == ["a"]
    assert [r.request_id for r in second.new_requests] == ["b"]


def test_long_prompts_are_chunked_and_finish():
    s = _scheduler(budget=8)
    s.add_request(_request("a", 30, max_tokens=3))
    outs = _run(s)
    assert [o.num_scheduled_tokens["a"] for o in outs] == [8, 8, 8, 6, 1, 1]


def test_chunking_disabled_waits_for_budget():
    s = _scheduler(budget=8, chunked=False)
    s.add_request(_request("a", 3))
    s.add_request(_request("b", 7))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 3}  # b (7 > 5 left) waits whole


def test_max_num_seqs_caps_running():
    s = _scheduler(max_seqs=2)
    for i in range(4):
        s.add_request(_request(f"r{i}", 3, arrival=i))
    outs = _run(s)
    assert set(outs[0].num_scheduled_tokens) == {"r0", "r1"}
    assert all(len(o.num_scheduled_tokens) <= 2 for o in outs)


def test_preemption_frees_newest_and_everyone_finishes():
    # 6 blocks of 4 = 24 tokens; three requests of 8-token prompts + 12 outputs cannot coexist.
    s = _scheduler(num_blocks=6, budget=64)
    for i in range(3):
        s.add_request(_request(f"r{i}", 8, max_tokens=12, arrival=i))
    finished_order = []
    runner = FakeRunner()
    while s.has_unfinished_requests():
        out = s.schedule()
        for core_out in s.update_from_output(out, runner.execute(out)).outputs:
            if core_out.finish_reason:
                finished_order.append(core_out.request_id)
        s.check_integrity()
    assert s.num_preemptions > 0
    assert finished_order[0] == "r0"  # the oldest is never the victim
    assert sorted(finished_order) == ["r0", "r1", "r2"]
    assert s.kv.pool.num_free == 6


def test_preempted_request_resumes_with_its_outputs():
    s = _scheduler(num_blocks=4, budget=64)  # 16 tokens
    s.add_request(_request("old", 4, max_tokens=10, arrival=0))
    s.add_request(_request("new", 4, max_tokens=10, arrival=1))
    runner = FakeRunner()
    resumed = None
    for _ in range(100):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        for new in out.new_requests:
            if new.request_id == "new" and new.output_token_ids:
                resumed = new
        s.update_from_output(out, runner.execute(out))
        s.check_integrity()
    assert resumed is not None and resumed.num_computed_tokens == 0
    assert resumed.output_token_ids == [7] * len(resumed.output_token_ids)


def test_priority_policy_runs_urgent_first_and_preempts_least_urgent():
    s = _scheduler(budget=4, policy="priority")
    s.add_request(_request("low", 4, arrival=0, priority=5))
    s.add_request(_request("high", 4, arrival=1, priority=-1))
    outs = _run(s)
    assert outs[0].num_scheduled_tokens == {"high": 4}


def test_abort_frees_blocks_and_tells_runner():
    s = _scheduler()
    s.add_request(_request("a", 5))
    s.add_request(_request("b", 5))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput())
    s.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    s.check_integrity()
    assert not s.has_unfinished_requests()
    assert s.schedule().finished_request_ids == {"a", "b"}


def test_abort_while_waiting():
    s = _scheduler(max_seqs=1)
    s.add_request(_request("a", 5))
    s.add_request(_request("b", 5))
    s.schedule()
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    s.check_integrity()
    assert s.num_waiting == 0 and s.num_running == 1


def test_preempted_request_resumes_from_its_cached_blocks():
    s = _scheduler(num_blocks=4, budget=64, caching=True)
    s.add_request(_request("a", 8, max_tokens=4))
    runner = FakeRunner()
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))   # a's prompt: two full blocks, cached
    s._preempt(s.running.pop(), SchedulerOutput())
    out = s.schedule()
    (new,) = out.new_requests
    assert new.num_computed_tokens == 8 and out.num_scheduled_tokens["a"] == 1
    s.check_integrity()


def test_a_request_waiting_on_a_claimed_prefix_lets_unrelated_ones_go_first():
    s = _scheduler(num_blocks=64, budget=10, caching=True)
    shared = list(range(100, 116))                   # four blocks nobody has cached
    s.add_request(Request("owner", shared + [1, 2], SamplingParams(max_tokens=1), 1))
    s.add_request(Request("sharer", shared + [3, 4], SamplingParams(max_tokens=1), 1))
    s.add_request(Request("other", [9] * 6, SamplingParams(max_tokens=1), 1))
    runner = FakeRunner()
    out = s.schedule()                               # owner takes 10 of the budget
    assert list(out.num_scheduled_tokens) == ["owner"]
    s.update_from_output(out, runner.execute(out))
    out = s.schedule()                               # owner's rest; sharer steps aside
    assert out.num_scheduled_tokens == {"owner": 8, "other": 2}
    s.update_from_output(out, runner.execute(out))
    out = s.schedule()                               # the prefix is cached: a 16-token hit
    (sharer,) = [n for n in out.new_requests if n.request_id == "sharer"]
    assert sharer.num_computed_tokens == 16 and out.num_scheduled_tokens["sharer"] == 2
    s.check_integrity()


def test_a_request_loading_from_the_file_store_steps_aside_then_starts_after_its_prefix():
    s = _scheduler(num_blocks=64, budget=64, caching=True)
    in_store: set[bytes] = set()
    s.kv.attach_tiers(HostCacheIndex(8), in_store.__contains__)
    s.add_request(_request("loading", 10))
    s.add_request(Request("other", [50] * 5, SamplingParams(max_tokens=1), 1))
    in_store.update(s.requests["loading"].block_hashes)   # both full blocks are on disk
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["other"]    # not held up by the load
    (load,) = out.kv.reads                           # the step's plan carries the read
    assert s.requests["loading"].status is RequestStatus.WAITING_FOR_KV
    s.check_integrity()
    s.update_from_output(out, FakeRunner().execute(out))
    s.finish_load(load, num_loaded=2)                # now in host memory (L2)
    out = s.schedule()
    (started,) = [n for n in out.new_requests if n.request_id == "loading"]
    assert started.num_computed_tokens == 8 and out.num_scheduled_tokens["loading"] == 2
    assert [copy.slot for copy in out.kv.loads] == [slot for _, slot in load.blocks]
    assert s.requests["loading"].status is RequestStatus.RUNNING
    assert s.kv.hit_tokens_by_tier["L3"] == 8
    s.check_integrity()


def test_a_finished_prefill_only_request_hands_its_held_blocks_back_to_the_caller():
    """Disaggregation's prefill side: the blocks come back in the step's update (the engine
    core's KV connector leases them), not in a list left on the scheduler."""
    s = _scheduler(caching=True)
    s.add_request(Request("lend", list(range(1, 11)), SamplingParams(
        max_tokens=1, kv_transfer_params={"do_remote_decode": True}), 1))
    out = s.schedule()
    update = s.update_from_output(out, FakeRunner().execute(out))
    (done,) = update.outputs
    assert done.finish_reason == "length" and done.kv_transfer_params is None
    hashes = list(update.holds["lend"])
    assert len(hashes) == 2 and s.kv.num_held == 1   # two full blocks of 10 tokens, held
    s.kv.release("lend")
    assert s.kv.num_held == 0
    s.check_integrity()


def test_a_failed_pull_under_the_fail_policy_returns_the_requests_last_output():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(
        group_layers([FullAttentionSpec(BLOCK, 1, 8, "float32")]), 64, enable_caching=True),
        kv_load_failure_policy="fail")
    s.kv.attach_tiers(HostCacheIndex(8), None, can_pull=True)
    prompt, hashes = list(range(1, 11)), []
    extend_block_hashes(hashes, prompt, BLOCK)
    s.add_request(Request("pull", prompt, SamplingParams(max_tokens=2, kv_transfer_params={
        "remote_host": "10.0.0.1", "remote_port": 7000, "remote_block_hashes": hashes}), 2))
    (load,) = s.schedule().kv.reads
    assert load.source is not None and s.requests["pull"].status is RequestStatus.WAITING_FOR_KV
    failed = s.finish_load(load, num_loaded=1)          # one of the two blocks arrived
    assert (failed.request_id, failed.finish_reason, failed.stop_reason) == (
        "pull", "error", "kv_transfer_failed")
    assert "pull" not in s.requests and not s.has_unfinished_requests()
    s.check_integrity()


def test_a_step_with_several_tokens_stops_anywhere_in_it():
    """A multi-token step (verified drafts): a stop token or max_tokens inside the run ends
    the request there; the tokens after it are dropped, logprobs trimmed to match."""
    s = _scheduler()
    params = SamplingParams(max_tokens=10, stop_token_ids=[9])
    s.add_request(Request("stop", [1, 2, 3], params, 10))
    s.add_request(_request("length", 3, max_tokens=2))
    out = s.schedule()
    result = ModelRunnerOutput(sampled_token_ids={"stop": [5, 9, 6], "length": [5, 6, 8]},
                               logprobs={"stop": [{5: None}, {9: None}, {6: None}]})
    outputs = {o.request_id: o for o in s.update_from_output(out, result).outputs}
    assert outputs["stop"].new_token_ids == [5, 9] and outputs["stop"].finish_reason == "stop"
    assert outputs["stop"].stop_reason == 9 and len(outputs["stop"].new_logprobs) == 2
    assert outputs["length"].new_token_ids == [5, 6]
    assert outputs["length"].finish_reason == "length"
    assert not s.has_unfinished_requests()
    s.check_integrity()
