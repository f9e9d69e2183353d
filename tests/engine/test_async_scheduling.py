"""Asynchronous scheduling: step N+1 is scheduled (and its tokens computed on the model
thread) before step N's output lands, and every request still gets the tokens of the
synchronous engine."""

from __future__ import annotations

import re
import threading

import pytest
import torch

from openinfer import LLM, SamplingParams
from openinfer.engine.scheduler import Scheduler
from openinfer.structured.params import StructuredOutputsParams


def _prompts(n: int, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (int(k),), generator=g).tolist()
            for k in torch.randint(2, 48, (n,), generator=g)]


def _params(stop_token: int) -> list[SamplingParams]:
    """Lengths ending inside and at the step boundary, a stop token, seeded sampling."""
    return [
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_token], ignore_eos=True),
        SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=9, ignore_eos=True,
                       logprobs=2),
        SamplingParams(temperature=0, max_tokens=6),
    ]


def _generate(llm: LLM, prompts, params):
    return _summary(llm.generate(prompts, params))


def _summary(outs):
    return [([c.token_ids for c in o.outputs], [c.finish_reason for c in o.outputs],
             [[sorted(lp) for lp in c.logprobs] if c.logprobs else None for c in o.outputs])
            for o in outs]


class _Overlap:
    """Counts steps scheduled while another was in flight, and where the model ran."""

    def __init__(self, monkeypatch) -> None:
        self.overlapped = 0
        self.model_threads: set[str] = set()
        original = Scheduler.schedule

        def schedule(scheduler, in_flight=None):
            self.overlapped += in_flight is not None and not in_flight.is_empty
            return original(scheduler, in_flight)

        monkeypatch.setattr(Scheduler, "schedule", schedule)

    def watch(self, llm: LLM) -> None:
        runner = llm.engine.core.executor.worker.runner
        execute = runner.execute

        def recording(sched):
            self.model_threads.add(threading.current_thread().name)
            return execute(sched)

        runner.execute = recording


@pytest.mark.parametrize("options", [
    dict(max_num_batched_tokens=16),  # every prompt chunked; prefills overlap decodes
    dict(block_size=4, kv_cache_memory=24 * 4 * 2 * 2 * 2 * 16 * 4, max_model_len=80),  # preempts
], ids=["chunked", "preempting"])
def test_same_tokens_as_synchronous_scheduling(qwen3_checkpoint, monkeypatch, options):
    prompts = _prompts(14)
    sync = LLM(str(qwen3_checkpoint), progress=False, **options)
    # A stop token the greedy run meets midway, so a step runs past a stop and is dropped.
    probe = sync.generate(prompts[3], SamplingParams(temperature=0, max_tokens=24,
                                                     ignore_eos=True))[0].outputs[0].token_ids
    params = [p for _ in range(2) for p in _params(probe[10])]
    expected = _generate(sync, prompts, params)
    assert expected[3][1] == ["stop"] and len(expected[3][0][0]) == 11

    overlap = _Overlap(monkeypatch)
    fast = LLM(str(qwen3_checkpoint), progress=False, async_scheduling=True, **options)
    overlap.watch(fast)
    assert _generate(fast, prompts, params) == expected
    assert overlap.overlapped > 10, "no step was scheduled while the previous one computed"
    assert overlap.model_threads == {"openinfer-model_0"}
    if "block_size" in options:
        assert fast.engine.core.scheduler.num_preemptions > 0
    # n > 1 and a second round on the warm engine (prefix-cache hits)
    many = SamplingParams(n=3, temperature=0.7, seed=5, max_tokens=8, ignore_eos=True)
    assert _generate(fast, prompts[:4], many) == _generate(sync, prompts[:4], many)


def test_abort_while_a_step_is_in_flight(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint), progress=False, async_scheduling=True)
    engine, core = llm.engine, llm.engine.core
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = _prompts(3, seed=9)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    finals = {}
    for _ in range(5):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert core._in_flight is not None  # a step computes while we abort
    aborted = engine.abort_request("r1")
    assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
    # The same request id again at once: the step in flight computed a row for the old one.
    engine.add_request("r1", prompts[1], params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    expected = LLM(str(qwen3_checkpoint), progress=False).generate(prompts, params)
    assert [finals[f"r{i}"].outputs[0].token_ids for i in range(3)] == [
        o.outputs[0].token_ids for o in expected]


def test_grammar_requests_overlap_their_masks_with_the_forward_pass(qwen3_checkpoint, monkeypatch):
    """A constrained request's masks need the step before landed: the model thread runs the
    forward pass meanwhile and samples once they are computed. Tokens as the synchronous
    engine's, grammars that end mid-batch, a request that ends while a step is in flight."""
    prompts = _prompts(6, seed=2)
    choice = SamplingParams(temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(
        choice=["alpha", "beta gamma"]))
    pattern = SamplingParams(temperature=0.8, seed=4, max_tokens=12,
                             structured_outputs=StructuredOutputsParams(regex="[a-z]{3,9}"))
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    params = [choice, plain, pattern, choice, short, pattern]
    sync = _generate(LLM(str(qwen3_checkpoint), progress=False), prompts, params)
    overlap = _Overlap(monkeypatch)
    fast = LLM(str(qwen3_checkpoint), progress=False, async_scheduling=True)
    overlap.watch(fast)
    outs = fast.generate(prompts, params)
    assert _summary(outs) == sync
    # The grammar rows got their own masks (the sync engine shares any bug in that).
    assert [(outs[i].outputs[0].text, outs[i].outputs[0].finish_reason) in (
        ("alpha", "stop"), ("beta gamma", "stop")) for i in (0, 3)] == [True, True]
    assert all(re.fullmatch("[a-z]{3,9}", outs[i].outputs[0].text) for i in (2, 5))
    assert overlap.overlapped >= 8, "constrained steps did not overlap"
    assert overlap.model_threads == {"openinfer-model_0"}
    assert _generate(fast, prompts[1:3], [plain, pattern]) == [sync[1], sync[2]]
