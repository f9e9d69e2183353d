"""The offline engine end to end on a real (tiny, random-weight) checkpoint.

Every fast or constrained path must give the tokens of the plain path.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from scipy.stats import chisquare

from openinfer import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(n: int = 6, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 40, 17, 64, 9, 33, 21, 50][:n]
    return [torch.randint(0, 1000, (k,), generator=g).tolist() for k in lengths]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_idle(llm: LLM) -> None:
    """No request left, no block held, refcounts consistent."""
    llm.engine.check_integrity()
    core = llm.engine.core
    assert not core.has_unfinished_requests()
    assert core.kv.pool.num_free == core.kv.pool.num_blocks
    assert not core.executor.worker.runner.requests


@pytest.fixture(scope="module")
def reference(qwen3_checkpoint) -> list[list[int]]:
    llm = LLM(str(qwen3_checkpoint), progress=False)
    out = _tokens(llm.generate(_prompts(), GREEDY))
    assert_idle(llm)
    return out


def test_tiny_kv_pool_forces_preemption_with_same_tokens(qwen3_checkpoint, reference):
    # 24 blocks of 4 tokens: the six requests need ~64 blocks together.
    llm = LLM(str(qwen3_checkpoint), block_size=4, kv_cache_memory=24 * 4 * 2 * 2 * 2 * 16 * 4,
              max_model_len=96, progress=False)
    assert llm.engine.core.kv.num_blocks == 24
    assert _tokens(llm.generate(_prompts(), GREEDY)) == reference
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert_idle(llm)


def test_the_cpu_kv_pool_default_comes_from_the_environment(qwen3_checkpoint, monkeypatch):
    from openinfer.config import CPU_KV_CACHE_MEMORY_ENV

    block_bytes = 16 * 2 * 2 * 2 * 16 * 4  # 16 tokens x 2 layers x K/V x 2 heads x 16 x fp32
    monkeypatch.setenv(CPU_KV_CACHE_MEMORY_ENV, f"{100 * block_bytes}")
    llm = LLM(str(qwen3_checkpoint), progress=False)
    assert llm.engine.core.kv.num_blocks == 100
    llm = LLM(str(qwen3_checkpoint), kv_cache_memory=50 * block_bytes, progress=False)
    assert llm.engine.core.kv.num_blocks == 50  # the argument wins
    monkeypatch.setenv(CPU_KV_CACHE_MEMORY_ENV, "lots")
    with pytest.raises(ValueError, match=CPU_KV_CACHE_MEMORY_ENV):
        LLM(str(qwen3_checkpoint), progress=False)


def test_tiny_token_budget_chunks_every_prompt(qwen3_checkpoint, reference):
    llm = LLM(str(qwen3_checkpoint), max_num_batched_tokens=4, progress=False)
    assert _tokens(llm.generate(_prompts(), GREEDY)) == reference
    assert_idle(llm)


def test_requests_arriving_while_others_decode(qwen3_checkpoint, reference):
    llm = LLM(str(qwen3_checkpoint), max_num_batched_tokens=32, progress=False)
    engine, prompts, done = llm.engine, _prompts(), {}
    engine.add_request("r0", prompts[0], GREEDY)
    step = 0
    while engine.has_unfinished_requests() or len(done) < len(prompts):
        # A new request joins every third step, while earlier ones are mid-decode.
        if step % 3 == 2 and step // 3 + 1 < len(prompts):
            i = step // 3 + 1
            engine.add_request(f"r{i}", prompts[i], GREEDY)
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids
        engine.check_integrity()
        step += 1
    assert [done[f"r{i}"] for i in range(len(prompts))] == reference
    assert_idle(llm)


def test_batch_composition_does_not_change_greedy_tokens(qwen3_checkpoint, reference):
    llm = LLM(str(qwen3_checkpoint), progress=False)
    prompts = _prompts()
    alone = [_tokens(llm.generate([p], GREEDY))[0] for p in prompts[:3]]
    assert alone == reference[:3]
    reordered = _tokens(llm.generate(prompts[::-1], GREEDY))[::-1]
    assert reordered == reference
    assert_idle(llm)


def test_seeded_sampling_is_independent_of_the_batch(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint), progress=False)
    prompts = _prompts()
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = _tokens(llm.generate([prompts[1]], seeded))[0]
    busy_params = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * len(prompts)
    busy_params[1] = seeded
    busy = _tokens(llm.generate(prompts, busy_params))[1]
    assert busy == alone
    # ... and under preemption, which recomputes the request from scratch.
    small = LLM(str(qwen3_checkpoint), block_size=4, kv_cache_memory=24 * 4 * 2 * 2 * 2 * 16 * 4,
                max_model_len=96, progress=False)
    scheduler, preempted = small.engine.core.scheduler, []
    preempt = scheduler._preempt

    def recording(req, out):  # the seeded request itself, after some of its samples
        preempted.append((req.sampling_params.seed, len(req.output_token_ids)))
        preempt(req, out)

    scheduler._preempt = recording
    # The seeded request last: the newest running request is the one preempted.
    order = [*range(len(prompts))[:1], *range(len(prompts))[2:], 1]
    outs = small.generate([prompts[i] for i in order], [busy_params[i] for i in order])
    assert _tokens(outs)[-1] == alone
    assert any(seed == 1234 and n > 0 for seed, n in preempted), preempted
    other = _tokens(llm.generate([prompts[1]], SamplingParams(
        temperature=1.0, top_p=0.9, max_tokens=16, seed=99, ignore_eos=True)))[0]
    assert other != alone
    assert_idle(llm)
    assert_idle(small)


def test_unseeded_sampling_matches_model_distribution(make_checkpoint, hf_model_loader):
    """Chi-square of 6000 first tokens against softmax(logits / T) on an 8-token vocab."""
    path = make_checkpoint("Qwen3ForCausalLM", vocab_size=8, hidden_size=32, num_layers=1)
    llm = LLM(str(path), skip_tokenizer_init=True, seed=0, progress=False)
    prompt = [1, 5, 2]
    with torch.no_grad():
        logits = hf_model_loader(path)(torch.tensor([prompt])).logits[0, -1].double()
    for params, expected in [
        (SamplingParams(temperature=0.7, max_tokens=1, n=6000), torch.softmax(logits / 0.7, -1)),
        (SamplingParams(temperature=1.3, top_k=3, max_tokens=1, n=6000),
         _restricted(torch.softmax(logits / 1.3, -1), torch.topk(logits, 3).indices)),
    ]:
        (out,) = llm.generate([prompt], params)
        counts = torch.bincount(torch.tensor([o.token_ids[0] for o in out.outputs]), minlength=8)
        support = expected > 0
        assert counts[~support].sum() == 0
        stat = chisquare(counts[support].double().numpy(),
                         (expected[support] * 6000).numpy())
        assert stat.pvalue > 1e-3, (counts, expected)
    assert_idle(llm)


def _restricted(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


def test_logprobs_and_prompt_logprobs_match_transformers(qwen3_checkpoint, hf_model_loader):
    llm = LLM(str(qwen3_checkpoint), max_num_batched_tokens=16, progress=False)  # chunked prompt
    prompt = _prompts()[3]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2,
                            ignore_eos=True)
    (out,) = llm.generate([prompt], params)
    completion = out.outputs[0]
    full = prompt + completion.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model_loader(qwen3_checkpoint)(torch.tensor([full])).logits[0], -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert prompt[pos] in entry and len(entry) <= 3
        for token_id, lp in entry.items():
            assert math.isclose(lp.logprob, ref[pos - 1, token_id].item(), abs_tol=1e-4)
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        pos = len(prompt) + i - 1
        top = torch.topk(ref[pos], 3).indices.tolist()
        assert set(top) <= set(entry) and entry[token].rank == 1  # greedy picks the top token
        assert entry[top[1]].rank == 2
        assert math.isclose(entry[token].logprob, ref[pos, token].item(), abs_tol=1e-4)
        assert isinstance(entry[token].decoded_token, str)
    assert_idle(llm)


def test_stop_strings_stop_tokens_and_lengths(qwen3_checkpoint, reference):
    llm = LLM(str(qwen3_checkpoint), progress=False)
    prompt = _prompts()[1]
    tok = llm.get_tokenizer()
    base = llm.generate([prompt], GREEDY)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 24
    assert base.text == tok.decode(base.token_ids, skip_special_tokens=True)

    # A stop string taken from the middle of the greedy text.
    stop = base.text[len(base.text) // 2: len(base.text) // 2 + 3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:base.text.index(stop)]
    kept = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=stop,
                                                 include_stop_str_in_output=True,
                                                 ignore_eos=True))[0].outputs[0]
    assert kept.text == base.text[:base.text.index(stop) + len(stop)]

    # A stop token id: generation ends on its first occurrence.
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24,
                                                stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == base.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id

    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=7))[0].outputs[0]
    assert out.token_ids == base.token_ids[:7] and out.finish_reason == "length"
    assert_idle(llm)


def test_min_tokens_and_ignore_eos(make_checkpoint, tmp_path):
    path = make_checkpoint("Qwen3ForCausalLM")
    prompt = _prompts()[0]
    first = LLM(str(path), progress=False).generate([prompt], GREEDY)[0].outputs[0].token_ids[0]
    # Make the model's first greedy token its EOS.
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [first]}))
    llm = LLM(str(path), progress=False)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert out.token_ids == [first] and out.finish_reason == "stop" and out.stop_reason is None
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10,
                                                ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 10 and out.token_ids[0] == first
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10,
                                                min_tokens=4))[0].outputs[0]
    assert len(out.token_ids) >= 4 and first not in out.token_ids[:4]
    assert_idle(llm)


def test_n_samples_and_timing(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint), progress=False)
    (out,) = llm.generate(["hello world"], SamplingParams(n=3, temperature=1.0, seed=5,
                                                          max_tokens=8, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert out.prompt == "hello world"
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finished_time
    (again,) = llm.generate(["hello world"], SamplingParams(n=3, temperature=1.0, seed=5,
                                                            max_tokens=8, ignore_eos=True))
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    (greedy,) = llm.generate(["hello world"], SamplingParams(n=2, temperature=0, max_tokens=8))
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert_idle(llm)


@pytest.mark.parametrize("make_call,field", [
    (lambda llm: llm.generate("", SamplingParams()), "prompt"),
    (lambda llm: llm.generate([[]], SamplingParams()), "prompt"),
    (lambda llm: llm.generate([[1] * 600], SamplingParams()), "max_model_len"),
    (lambda llm: llm.generate("hi", SamplingParams(max_tokens=0)), "max_tokens"),
    (lambda llm: llm.generate("hi", SamplingParams(top_p=0)), "top_p"),
    (lambda llm: llm.generate("hi", SamplingParams(top_p=1.5)), "top_p"),
    (lambda llm: llm.generate("hi", SamplingParams(stop=7)), "stop"),
    (lambda llm: llm.generate("hi", SamplingParams(stop=["ok", 3])), "stop"),
    (lambda llm: llm.generate("hi", SamplingParams(temperature=-1)), "temperature"),
    (lambda llm: llm.generate([[10**9]], SamplingParams()), "vocabulary"),
    (lambda llm: llm.generate([3.5], SamplingParams()), "prompt"),
])
def test_bad_input_is_a_clear_error_and_engine_keeps_serving(qwen3_checkpoint, reference,
                                                             make_call, field):
    llm = LLM(str(qwen3_checkpoint), progress=False)
    with pytest.raises(ValueError, match=field):
        make_call(llm)
    assert_idle(llm)
    assert _tokens(llm.generate(_prompts()[:2], GREEDY)) == reference[:2]
    assert_idle(llm)


def test_a_bad_prompt_in_a_batch_queues_nothing(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint), progress=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", ""], SamplingParams())
    assert_idle(llm)
