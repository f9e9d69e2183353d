"""Prefix caching end to end in the engine: hits change nothing but the work done."""

from __future__ import annotations

import random

import pytest
from kv_pages import assert_same_pages, prompt_pages

from openinfer import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


@pytest.fixture(scope="module")
def plain(qwen3_checkpoint) -> LLM:
    return LLM(str(qwen3_checkpoint), enable_prefix_caching=False, progress=False)


def _alone(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY):
    return llm.generate([prompt], params)[0]


def test_hits_from_prompts_and_from_generated_blocks_keep_greedy_tokens(qwen3_checkpoint, plain):
    llm = LLM(str(qwen3_checkpoint), progress=False)
    system = _random_ids(70, seed=1)
    first = system + _random_ids(9, seed=2)
    out = _alone(llm, first)
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == _alone(plain, first).outputs[0].token_ids

    again = _alone(llm, first)  # the whole prompt is cached; its last token is recomputed
    assert again.num_cached_tokens == (len(first) - 1) // 16 * 16
    assert again.outputs[0].token_ids == out.outputs[0].token_ids

    sibling = system + _random_ids(5, seed=3)
    hit = _alone(llm, sibling)
    assert hit.num_cached_tokens == 64  # the four full blocks of the shared system prompt
    assert hit.outputs[0].token_ids == _alone(plain, sibling).outputs[0].token_ids

    # The next turn resends the conversation: blocks filled while decoding hit too, and
    # the partial last block (every token the first request computed: all but its last).
    turn2 = first + out.outputs[0].token_ids + _random_ids(20, seed=4)
    hit = _alone(llm, turn2)
    assert hit.num_cached_tokens == len(first) + 12 - 1
    assert hit.outputs[0].token_ids == _alone(plain, turn2).outputs[0].token_ids
    core = llm.engine.core
    assert core.kv.num_hit_tokens > 0 and core.kv.num_queried_tokens > core.kv.num_hit_tokens

    # The hit blocks sit in the request's table in their order (its tokens cannot tell).
    cousin = system + _random_ids(20, seed=8)  # 4 hit blocks, then one computed
    hits = core.kv.num_hit_tokens
    assert_same_pages(prompt_pages(llm, cousin), prompt_pages(plain, cousin))
    assert core.kv.num_hit_tokens - hits == 64


@pytest.mark.parametrize("dtype,backend", [("float32", "auto"), ("float32", "torch"),
                                           ("bfloat16", "cpu"), ("bfloat16", "torch")])
def test_a_kept_partial_block_is_taken_by_one_continuation(qwen3_checkpoint, dtype, backend):
    """Two continuations of one finished request arrive together: the first takes its partial
    last block (and writes on it: a prefill that starts mid-block), the second recomputes
    those rows; both keep the tokens of an engine without caching, in each dtype and on the
    attention path this CPU picks and on the one it does not. (bf16 under --batch-invariant:
    the kept rows were computed by decode steps, whose GEMMs round otherwise in bf16 than
    the plain engine's prefill; fp32 is exact without it.)"""
    options = {"dtype": dtype, "attention_backend": backend, "progress": False,
               "batch_invariant": dtype == "bfloat16"}
    llm = LLM(str(qwen3_checkpoint), **options)
    plain = LLM(str(qwen3_checkpoint), enable_prefix_caching=False, **options)
    first = _random_ids(40, seed=11)
    turn = first + _alone(llm, first).outputs[0].token_ids  # 51 computed: 3 blocks + 3 rows
    prompts = [turn + _random_ids(9, seed=12), turn + _random_ids(9, seed=13)]
    outs = llm.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [51, 48]
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _alone(plain, prompt).outputs[0].token_ids


def test_cache_salt_isolates_tenants(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint), progress=False)
    prompt = _random_ids(40, seed=5)
    salted = lambda salt: SamplingParams(temperature=0, max_tokens=2, cache_salt=salt)
    assert _alone(llm, prompt, salted("a")).num_cached_tokens == 0
    assert _alone(llm, prompt, salted("b")).num_cached_tokens == 0
    assert _alone(llm, prompt, GREEDY).num_cached_tokens == 0  # unsalted is its own tenant
    assert _alone(llm, prompt, salted("a")).num_cached_tokens == 32
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_prompt_logprobs_requests_do_not_take_hits(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint), progress=False)
    prompt = _random_ids(40, seed=6)
    _alone(llm, prompt)
    scored = _alone(llm, prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))
    assert scored.num_cached_tokens == 0 and all(e is not None for e in scored.prompt_logprobs[1:])


def test_a_burst_sharing_a_new_prefix_computes_it_once(make_checkpoint):
    checkpoint = str(make_checkpoint(num_layers=1, max_position_embeddings=1280))
    system = _random_ids(1000, seed=7)  # 62 full blocks + 8 tokens
    prompts = [system + _random_ids(8, seed=100 + i) for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = LLM(checkpoint, enable_prefix_caching=False, progress=False)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = LLM(checkpoint, progress=False)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # The first request computes all 1008 tokens; the 15 others only past the 992 shared.
    assert llm.engine.core.scheduler.num_prompt_tokens_computed == 1008 + 15 * 16
    assert sorted(o.num_cached_tokens for o in outs) == [0] + [992] * 15
    assert plain.engine.core.scheduler.num_prompt_tokens_computed == 16 * 1008


def test_multi_turn_under_memory_pressure_keeps_invariants_every_step(qwen3_checkpoint, plain):
    """A pool of 20 blocks of 4 tokens, smaller than the conversations' working set."""
    llm = LLM(str(qwen3_checkpoint), block_size=4, kv_cache_memory=20 * 4 * 2 * 2 * 2 * 16 * 4,
              max_model_len=80, progress=False)
    core = llm.engine.core
    assert core.kv.num_blocks == 20
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    conversations = [_random_ids(6, seed=200 + u) for u in range(4)]
    events: list = []
    core.event_sink = events.extend
    for turn in range(5):
        for u, history in enumerate(conversations):
            core.add_request(f"u{u}t{turn}", list(history), params)
        done: dict[str, list[int]] = {}
        while core.has_unfinished_requests():
            for out in core.step():
                done.setdefault(out.request_id, []).extend(out.new_token_ids)
            core.check_integrity()
        for u, history in enumerate(conversations):
            expected = _alone(plain, history, params).outputs[0].token_ids
            assert done[f"u{u}t{turn}"] == expected
            history += expected + _random_ids(5, seed=300 + 10 * u + turn)
    assert any(type(e).__name__ == "BlockRemoved" for e in events)  # evictions happened
    assert core.kv.num_hit_tokens > 0
    assert core.kv.pool.num_free == core.kv.pool.num_blocks
