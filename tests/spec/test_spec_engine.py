"""Speculative decoding end to end in the engine: every drafter gives plain decoding's
greedy tokens (mixed batches, preemption, stops, max_tokens), seeded requests are
batch-independent, rejected drafts leave no trace in the KV pool or prefix cache."""

from __future__ import annotations

import json
import random

import pytest
from conftest import build_checkpoint
from dspark_checkpoint import build_dspark_drafter

from openinfer import LLM, SamplingParams
from openinfer.spec import planner

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        body = [rng.randrange(3, 1000) for _ in range(rng.randrange(5, 50))]
        if i % 2:  # something to copy: a repeated span
            body = body + body[:12] + body
        prompts.append(body)
    return prompts


@pytest.fixture(scope="module")
def draft_checkpoint(tmp_path_factory, tokenizer):
    return build_checkpoint(tmp_path_factory.mktemp("draft"), "Qwen3ForCausalLM", tokenizer,
                            num_layers=1, seed=5)


@pytest.fixture(scope="module")
def plain_outputs(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint), progress=False)
    return llm, [o.outputs[0].token_ids for o in llm.generate(_prompts(8), GREEDY)]


def _spec(method: str, k: int = 4, **extra) -> dict:
    return {"method": method, "num_speculative_tokens": k, **extra}


def _spec_stats(llm: LLM) -> dict:
    return {k: v for k, v in llm.engine.core.stats().items() if k.startswith("spec_")}


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "self_draft"])
def test_greedy_tokens_equal_plain_decoding_for_every_drafter(qwen3_checkpoint, draft_checkpoint,
                                                             plain_outputs, method):
    extra = {}
    if method == "draft_model":
        extra = {"model": str(draft_checkpoint)}
    elif method == "self_draft":  # the target as its own draft: every draft is accepted
        method, extra = "draft_model", {"model": str(qwen3_checkpoint)}
    llm = LLM(str(qwen3_checkpoint), progress=False, speculative_config=_spec(method, **extra))
    outs = llm.generate(_prompts(8), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs[1]
    stats = _spec_stats(llm)
    assert stats["spec_num_draft_tokens"] > 0
    if extra.get("model") == str(qwen3_checkpoint):
        assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]
    elif method != "draft_model":  # a random 1-layer draft agrees with nothing
        assert stats["spec_num_accepted_tokens"] > 0
    llm.engine.check_integrity()


def test_mixed_batches_preemption_stops_and_max_tokens(qwen3_checkpoint, plain_outputs):
    plain, expected = plain_outputs
    prompts = _prompts(8)
    # A small cache (preemption under load), greedy and sampled requests in one batch, a
    # stop token that falls inside accepted runs, and max_tokens cutting a run short.
    llm = LLM(str(qwen3_checkpoint), progress=False, speculative_config=_spec("ngram", 5),
              kv_cache_memory=24 * 16 * 2 * 2 * 16 * 4 * 2, max_model_len=256)
    stop_token = expected[1][20]
    params = []
    for i in range(len(prompts)):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=30, ignore_eos=True))
        elif i == 1:
            params.append(SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                         stop_token_ids=[stop_token]))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=17 + i, ignore_eos=True))
    outs = llm.generate(prompts, params)
    assert llm.engine.core.stats()["num_preemptions"] > 0
    reference = plain.generate(prompts, params)
    for i, (out, ref) in enumerate(zip(outs, reference)):
        if params[i].temperature == 0:
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids, i
            assert out.outputs[0].finish_reason == ref.outputs[0].finish_reason
    assert outs[1].outputs[0].token_ids[-1] == stop_token
    assert outs[1].outputs[0].finish_reason == "stop"
    assert _spec_stats(llm)["spec_num_accepted_tokens"] > 0
    llm.engine.check_integrity()


def test_seeded_requests_are_the_same_alone_or_batched_and_logprobs_cover_every_token(
        qwen3_checkpoint, draft_checkpoint):
    llm = LLM(str(qwen3_checkpoint), progress=False,
              speculative_config=_spec("draft_model", 3, model=str(qwen3_checkpoint)))
    prompts = _prompts(6, seed=3)
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True,
                            logprobs=2)
    batched = llm.generate(prompts, params)
    alone = llm.generate(prompts[2:3], params)
    assert alone[0].outputs[0].token_ids == batched[2].outputs[0].token_ids
    for out in batched:
        completion = out.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids) == 24
        assert all(token in entry for token, entry in zip(completion.token_ids, completion.logprobs))
    assert _spec_stats(llm)["spec_num_accepted_tokens"] > 0


def test_prefix_cache_never_holds_a_rejected_token(qwen3_checkpoint, plain_outputs):
    llm = LLM(str(qwen3_checkpoint), progress=False, speculative_config=_spec("suffix", 4))
    prompts = _prompts(8)
    first = llm.generate(prompts, GREEDY)
    assert _spec_stats(llm)["spec_num_draft_tokens"] > _spec_stats(llm)["spec_num_accepted_tokens"]
    # The prompts plus their outputs again: the cached blocks must hold the real tokens' KV.
    again = [p + o.outputs[0].token_ids[:-1] for p, o in zip(prompts, first)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    hits = llm.generate(again, params)
    assert sum(o.num_cached_tokens for o in hits) > 0
    plain, _ = plain_outputs
    cold = plain.generate(again, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in hits] == [o.outputs[0].token_ids for o in cold]


def test_confidence_scheduler_profiles_once_and_keeps_greedy_tokens(qwen3_checkpoint, plain_outputs,
                                                                   tmp_path):
    spec = _spec("ngram", 4, scheduler="confidence", sps_cache_dir=str(tmp_path))
    llm = LLM(str(qwen3_checkpoint), progress=False, speculative_config=spec)
    (profile,) = tmp_path.glob("*.json")
    points = json.loads(profile.read_text())["points"]
    assert points[0][0] == 1 and len(points) >= 5
    assert [o.outputs[0].token_ids for o in llm.generate(_prompts(8), GREEDY)] == plain_outputs[1]
    mtime = profile.stat().st_mtime_ns
    LLM(str(qwen3_checkpoint), progress=False, speculative_config=spec)  # read, not profiled
    assert profile.stat().st_mtime_ns == mtime


@pytest.mark.parametrize("config, message", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"tokens must be an integer in \[1, 16\]"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookup": 3}, "unknown field.*lookup"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model .the draft checkpoint. is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "scheduler": "greedy"}, "scheduler must be"),
])
def test_bad_speculative_configs_are_refused_at_start(qwen3_checkpoint, config, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(qwen3_checkpoint), progress=False, speculative_config=config)


def test_a_draft_with_another_vocabulary_or_tokenizer_is_refused(qwen3_checkpoint, tmp_path,
                                                                 tokenizer):
    other_vocab = build_checkpoint(tmp_path / "v", "Qwen3ForCausalLM", tokenizer, num_layers=1,
                                   vocab_size=2048)
    with pytest.raises(ValueError, match="vocabulary has 2048 entries"):
        LLM(str(qwen3_checkpoint), progress=False,
            speculative_config=_spec("draft_model", 2, model=str(other_vocab)))
    from openinfer.demo import build_demo_tokenizer

    other_tokenizer = build_checkpoint(tmp_path / "t", "Qwen3ForCausalLM",
                                       build_demo_tokenizer(512), num_layers=1,
                                       vocab_size=-(-len(tokenizer) // 64) * 64)
    with pytest.raises(ValueError, match="tokenizer differs"):
        LLM(str(qwen3_checkpoint), progress=False,
            speculative_config=_spec("draft_model", 2, model=str(other_tokenizer)))


def test_a_stop_string_inside_an_accepted_run_ends_the_output_where_plain_decoding_does(
        qwen3_checkpoint, plain_outputs):
    plain, _ = plain_outputs
    # The target as its own draft: runs of five tokens are accepted whole.
    llm = LLM(str(qwen3_checkpoint), progress=False,
              speculative_config=_spec("draft_model", 4, model=str(qwen3_checkpoint)))
    prompt = _prompts(1, seed=9)[0]
    full = plain.generate([prompt], GREEDY)[0].outputs[0]
    tokenizer = plain.get_tokenizer()
    checked = 0
    for cut in (7, 13, 22):  # stop strings completed at various offsets inside runs
        piece = tokenizer.decode(full.token_ids[cut:cut + 1]).strip()
        if len(piece) < 2 or piece not in full.text:
            continue
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[piece],
                                logprobs=1)
        want = plain.generate([prompt], params)[0].outputs[0]
        got = llm.generate([prompt], params)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason) == (
            want.text, want.token_ids, want.finish_reason)
        assert len(got.logprobs) == len(got.token_ids)
        checked += 1
    assert checked >= 2
    assert _spec_stats(llm)["spec_num_accepted_tokens"] > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_model+confidence",
                                    "dspark+confidence", "dspark+budget"])
def test_sampled_tokens_follow_plain_decodings_distribution(qwen3_checkpoint, draft_checkpoint,
                                                            plain_outputs, method, tmp_path,
                                                            monkeypatch):
    """Two-sample chi-square: the tokens at output positions 1-3 (verified, not the first
    one sampled after the prompt) of 300 seeded requests, with and without speculation,
    given the most common tokens before them. The prompt X + G + X + G, G being X's greedy
    continuation, makes n-gram drafts (point masses); the draft model is an unrelated
    random one (full draft distributions, mostly rejected: the residual draws are tested).
    A low temperature makes the random model's distributions peaked enough to compare.
    ``+confidence``: the confidence scheduler decides which drafts are verified (DSpark's
    from its confidence head's estimates, a random drafter's too); ``+budget``: DeepInfer's
    production schedule, DSpark drafting within its budget. (At this
    temperature a drawn draft is nearly always its distribution's top token, so this would
    not see a confidence read off the drawn token: tests/spec/test_confidence.py does.)"""
    from scipy.stats import chi2_contingency

    plain, _ = plain_outputs
    method, _, scheduler = method.partition("+")
    extra = {"model": str(draft_checkpoint)} if method == "draft_model" else {"prompt_lookup_min": 1}
    if method == "dspark":
        extra = {"model": str(build_dspark_drafter(tmp_path / "dspark", qwen3_checkpoint))}
    if scheduler:
        extra |= {"scheduler": scheduler, "sps_cache_dir": str(tmp_path)}
    if scheduler == "budget":
        # The real budget follows this machine's step times, and this random drafter's
        # drafts seldom pay: too few would reach verification. Half the settled drafts
        # instead (a count, never a value, as the real search's inputs are settled).
        monkeypatch.setattr(planner, "best_draft_rows", lambda pool, *args: len(pool) // 2)
    llm = LLM(str(qwen3_checkpoint), progress=False, speculative_config=_spec(method, 3, **extra))

    def runs(engine: LLM, prompt: list[int], first_seed: int, count: int = 300) -> list[list[int]]:
        params = [SamplingParams(temperature=0.05, seed=first_seed + s, max_tokens=4,
                                 ignore_eos=True) for s in range(count)]
        return [o.outputs[0].token_ids for o in engine.generate([prompt] * count, params)]

    def drafts_verified(prompt: list[int]) -> int:
        before = _spec_stats(llm)["spec_num_draft_tokens"]
        runs(llm, prompt, 5000, count=30)
        return _spec_stats(llm)["spec_num_draft_tokens"] - before

    # A random model's continuation of a repeated text is hard to foresee: of a few such
    # prompts, take the one where most drafts reach verification.
    candidates = []
    for seed in range(6):
        x = _prompts(1, seed=seed)[0][:30]
        g = plain.generate([x], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        candidates.append(x + g[0].outputs[0].token_ids + x + g[0].outputs[0].token_ids)
    prompt = max(candidates, key=drafts_verified)
    before = _spec_stats(llm)["spec_num_draft_tokens"]
    spec_runs, plain_runs = runs(llm, prompt, 0), runs(plain, prompt, 1000)
    assert _spec_stats(llm)["spec_num_draft_tokens"] - before > 100
    compared = 0
    for position in (1, 2, 3):
        prefixes = [tuple(r[:position]) for r in plain_runs]
        prefix = max(set(prefixes), key=prefixes.count)
        spec = [r[position] for r in spec_runs if tuple(r[:position]) == prefix]
        ref = [r[position] for r in plain_runs if tuple(r[:position]) == prefix]
        if min(len(spec), len(ref)) < 40:
            continue
        common = sorted(t for t in set(spec) | set(ref) if spec.count(t) + ref.count(t) >= 10)
        table = [[spec.count(t), ref.count(t)] for t in common]
        table.append([sum(t not in common for t in spec), sum(t not in common for t in ref)])
        table = [row for row in table if sum(row)]
        assert chi2_contingency(table).pvalue > 1e-3, (position, table)
        compared += 1
    assert compared >= 2
