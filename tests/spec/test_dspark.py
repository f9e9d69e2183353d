"""DSpark, DeepSeek's block drafter, on a dense target: every draft and confidence the engine
proposes is what an independent float64 reference computes from the two checkpoints
(tests/dspark_checkpoint.py), the greedy tokens are plain decoding's, and drafters the
target cannot feed are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from dspark_checkpoint import DSparkReference, build_dspark_drafter

from openinfer import LLM, SamplingParams


@pytest.fixture(scope="module")
def dspark_drafter(tmp_path_factory, qwen3_checkpoint):
    return build_dspark_drafter(tmp_path_factory.mktemp("dspark"), qwen3_checkpoint)


def _spec(drafter, k: int = 3, **extra) -> dict:
    return {"method": "dspark", "num_speculative_tokens": k, "model": str(drafter), **extra}


def _capture_drafts(llm: LLM) -> list[tuple[list[int], list[int], list[float]]]:
    """(the request's tokens then, the drafts, their confidences) for every proposal."""
    core = llm.engine.core
    seen = []
    update = core.scheduler.update_from_output

    def capture(scheduled, result):
        for request_id, draft in result.drafts.items():
            req = core.scheduler.requests.get(request_id)
            if req is not None and draft.token_ids:
                tokens = (list(req.prompt_token_ids) + list(req.output_token_ids)
                          + list(result.sampled_token_ids[request_id]))
                seen.append((tokens, list(draft.token_ids), list(draft.confidences)))
        return update(scheduled, result)

    core.scheduler.update_from_output = capture
    return seen


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_drafts_and_confidences_are_the_references_and_greedy_tokens_plain_decodings(
        qwen3_checkpoint, dspark_drafter, backend):
    """``cpu``: the target's layers in one C++ call, which hands back the features; ``torch``:
    the Python layers, which keep them."""
    import transformers

    prompts = [[5 + (7 * i + 3 * j) % 900 for j in range(9 + 13 * i)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids
                for o in LLM(str(qwen3_checkpoint), progress=False).generate(prompts, params)]
    llm = LLM(str(qwen3_checkpoint), progress=False, speculative_config=_spec(dspark_drafter),
              max_num_batched_tokens=16, attention_backend=backend)  # long prompts in chunks
    proposals = _capture_drafts(llm)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.core.stats()["spec_num_draft_tokens"] > 0
    llm.engine.check_integrity()
    fused = llm.engine.core.executor.worker.model.model.cpu_layers
    assert (fused.get(torch.float32) is not None) == (backend == "cpu"), fused

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        qwen3_checkpoint, dtype=torch.float64, attn_implementation="eager").eval()
    reference = DSparkReference(dspark_drafter, hf)
    assert len(proposals) >= 10
    for tokens, drafts, confidences in proposals[::3]:
        want_drafts, want_confidences = reference.drafts(tokens, len(drafts))
        assert drafts == want_drafts, tokens
        assert confidences == pytest.approx(want_confidences, abs=1e-4)
        assert len(set(confidences)) > 1  # the head's, not a constant


def test_prefix_hits_and_the_confidence_scheduler_keep_plain_tokens(qwen3_checkpoint,
                                                                   dspark_drafter, tmp_path):
    """A second pass over the same prompts reads the drafter's context K/V from the prefix
    cache (written while the first pass computed them): the same drafts, the same tokens."""
    prompts = [[11 + (5 * i + 7 * j) % 800 for j in range(40)] for i in range(2)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [o.outputs[0].token_ids
                for o in LLM(str(qwen3_checkpoint), progress=False).generate(prompts, params)]
    llm = LLM(str(qwen3_checkpoint), progress=False, enable_prefix_caching=True,
              speculative_config=_spec(dspark_drafter, 4, scheduler="confidence",
                                       sps_cache_dir=str(tmp_path)))
    proposals = _capture_drafts(llm)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    cold = list(proposals)
    proposals.clear()
    second = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert first == second == expected
    assert llm.engine.core.stats()["prefix_cache_hits"] > 0
    # (The confidence scheduler may verify other prefixes the second time: compare the
    # proposals made at the same tokens; other batch shapes round the last float bit.)
    made = {tuple(tokens): (drafts, confidences) for tokens, drafts, confidences in cold}
    again = [(drafts, pytest.approx(confidences, abs=1e-5)) == made[tuple(tokens)]
             for tokens, drafts, confidences in proposals if tuple(tokens) in made]
    assert len(again) >= 2 and all(again)
    llm.engine.check_integrity()


def test_under_a_budget_it_drafts_the_likeliest_prefixes_of_the_references(
        qwen3_checkpoint, dspark_drafter, tmp_path, monkeypatch):
    """The budget scheduler tells the drafter the draft rows the next step verifies: it
    drafts no more tokens at any position than that, each proposal a prefix of what the
    reference drafts; the greedy tokens stay plain decoding's. (The budget is a third of the
    settled drafts here: the real one follows this machine's step times.)"""
    import transformers

    from openinfer.spec import planner

    monkeypatch.setattr(planner, "best_draft_rows", lambda pool, *args: len(pool) // 3)

    prompts = [[9 + (11 * i + 5 * j) % 700 for j in range(20 + 3 * i)] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [o.outputs[0].token_ids
                for o in LLM(str(qwen3_checkpoint), progress=False).generate(prompts, params)]
    llm = LLM(str(qwen3_checkpoint), progress=False,
              speculative_config=_spec(dspark_drafter, 3, scheduler="budget",
                                       sps_cache_dir=str(tmp_path)))
    core = llm.engine.core
    steps = []
    update = core.scheduler.update_from_output

    def capture(scheduled, result):
        steps.append((scheduled.draft_budget, len(result.drafts) if result.drafts else 0,
                      [list(d.token_ids) for d in result.drafts.values()]))
        return update(scheduled, result)

    core.scheduler.update_from_output = capture
    proposals = _capture_drafts(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    budgeted = [(budget, drafts) for budget, _, drafts in steps if budget is not None]
    assert budgeted
    for budget, drafts in budgeted:
        for position in range(3):
            assert sum(len(d) > position for d in drafts) <= budget
    # Some steps drafted less than every sampled request's k tokens.
    assert any(sum(map(len, drafts)) < 3 * sampled for budget, sampled, drafts in steps
               if budget is not None), steps
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        qwen3_checkpoint, dtype=torch.float64, attn_implementation="eager").eval()
    reference = DSparkReference(dspark_drafter, hf)
    assert len(proposals) >= 10 and any(len(drafts) > 1 for _, drafts, _ in proposals)
    for tokens, drafts, confidences in proposals[::2]:
        want_drafts, want_confidences = reference.drafts(tokens, len(drafts))
        assert drafts == want_drafts, tokens
        assert confidences == pytest.approx(want_confidences, abs=1e-4)
    llm.engine.check_integrity()


@pytest.mark.parametrize("change, message", [
    ({"num_speculative_tokens": 5}, "exceeds the DSpark drafter's block"),
    ({"config": {"hidden_size": 32}}, "must be the target's"),
    ({"config": {"dspark_target_layer_ids": [0, 2]}}, "must name layers of the target"),
    ({"config": {"architectures": ["Qwen3ForCausalLM"]}}, "is not a DSpark drafter"),
    ({"config": {"sliding_window": 16}}, "sliding_window is not supported"),
    ({"model": None}, "a drafter ships only for the built-in smollm2"),
])
def test_drafters_the_target_cannot_feed_are_refused(qwen3_checkpoint, dspark_drafter, tmp_path,
                                                     change, message):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "model.safetensors").symlink_to(dspark_drafter / "model.safetensors")
    config = json.loads((dspark_drafter / "config.json").read_text()) | change.get("config", {})
    (drafter / "config.json").write_text(json.dumps(config))
    spec = _spec(drafter) | {k: v for k, v in change.items() if k != "config"}
    with pytest.raises(ValueError, match=message):
        LLM(str(qwen3_checkpoint), progress=False, speculative_config=spec)


def test_split_over_two_ranks_the_drafter_drafts_as_one(qwen3_checkpoint, dspark_drafter):
    """Under TP=2 the draft layers are split like the target's (heads, MLP features, their
    own share of the context K/V), the embeddings and head are the target's split ones:
    the same drafts and confidences as one rank, and plain greedy tokens."""
    prompts = [[5 + (7 * i + 3 * j) % 900 for j in range(9 + 13 * i)] for i in range(2)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    runs = {}
    for size in (1, 2):
        llm = LLM(str(qwen3_checkpoint), progress=False, tensor_parallel_size=size,
                  speculative_config=_spec(dspark_drafter))
        try:
            proposals = _capture_drafts(llm)
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            runs[size] = tokens, proposals
        finally:
            llm.engine.core.shutdown()
    (one_tokens, one), (two_tokens, two) = runs[1], runs[2]
    assert one_tokens == two_tokens
    assert [(t, d) for t, d, _ in one] == [(t, d) for t, d, _ in two] and one
    for (_, _, c1), (_, _, c2) in zip(one, two):
        assert c1 == pytest.approx(c2, abs=1e-4)


@pytest.mark.parametrize("dtype, kv_cache_dtype", [("bfloat16", "auto"), ("bfloat16", "fp8")])
def test_a_bfloat16_target_drafts_and_keeps_plain_tokens(qwen3_checkpoint, dspark_drafter,
                                                         dtype, kv_cache_dtype):
    """In bfloat16 the drafter is built in the target's dtype (its RoPE tables stay float32
    for the kernels) and the greedy tokens are plain bfloat16 decoding's; with a float8 cache
    its context K/V are stored and read back scaled like every layer's."""
    prompts = [[5 + (7 * i + 3 * j) % 900 for j in range(9 + 13 * i)] for i in range(2)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    options = dict(dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    plain = LLM(str(qwen3_checkpoint), progress=False, **options)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = LLM(str(qwen3_checkpoint), progress=False, **options,
              speculative_config=_spec(dspark_drafter))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.core.stats()["spec_num_draft_tokens"] > 0
    llm.engine.check_integrity()


def test_the_drafter_that_ships_for_smollm2_is_accepted_and_keeps_plain_tokens():
    """``{"method": "dspark"}`` with no path on the built-in model loads the trained drafter
    of openinfer/drafters (scripts/train_dspark.py): on ordinary chat questions (not its
    training text) its drafts are accepted far above a random drafter's, and the greedy
    text is plain decoding's. (In float32: in bfloat16 a verify step's 5-row GEMMs round
    otherwise than a decode's 1-row ones, and a near tie may then go the other way; only
    --batch-invariant promises bfloat16's tokens.)"""
    plain = LLM("smollm2", progress=False, max_model_len=1024, dtype="float32")
    tok = plain.get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                  add_generation_prompt=True),
                          add_special_tokens=False)
               for q in ("How do bees make honey?", "Write a short note to a neighbour about a lost key.")]
    params = SamplingParams(temperature=0, max_tokens=48)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = LLM("smollm2", progress=False, max_model_len=1024, dtype="float32",
              speculative_config={"method": "dspark", "num_speculative_tokens": 4})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.engine.core.stats()
    # (A random drafter's drafts are accepted about once in the vocabulary's 49152; this one's
    # about one in 17 here: a weak drafter on chat, docs/speculative.md has its figures.)
    assert stats["spec_num_accepted_tokens"] > 0.03 * stats["spec_num_draft_tokens"] > 0, stats


def test_a_request_that_reaches_the_context_limit_ends_there(qwen3_checkpoint, dspark_drafter):
    """The block of the last token before max_model_len reaches past the RoPE table (those
    rows' drafts can never be verified): the request ends at the limit with plain tokens."""
    prompt = [5 + (7 * j) % 900 for j in range(500)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(str(qwen3_checkpoint), progress=False, max_model_len=512)
    expected = plain.generate([prompt], params)[0].outputs[0]
    llm = LLM(str(qwen3_checkpoint), progress=False, max_model_len=512,
              speculative_config=_spec(dspark_drafter))
    out = llm.generate([prompt], params)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (expected.token_ids, expected.finish_reason)
    assert len(prompt) + len(out.token_ids) == 512
    llm.engine.check_integrity()
