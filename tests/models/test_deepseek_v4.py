"""DeepSeek-V4 matches transformers' no-cache forward on a tiny random checkpoint with every
layer type (sliding, CSA with its indexer, HCA), hash and score-routed MoE layers and
hyper-connections; through the paged engine with prefix caching, the same tokens. The
engine-level tests (file store, disaggregation, speculation) also run DeepSeek-V4.1, whose
slots are the same kinds arranged otherwise (tests/models/test_deepseek_v41.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEEPSEEK_V4, randomize_v4, run_disaggregated
from test_hf_parity import PagedModel, _hf_logits, _prompts
from v41_checkpoint import build_v41_checkpoint

from openinfer import LLM, SamplingParams


def _checkpoint(make_checkpoint, **overrides):
    path = make_checkpoint("DeepseekV4ForCausalLM", extra_config={**DEEPSEEK_V4, **overrides},
                           num_layers=4, num_heads=4, num_kv_heads=1, head_dim=32, intermediate_size=32)
    randomize_v4(path)
    return path


@pytest.fixture(params=["v4", "v4.1"])
def v4_family(request, make_checkpoint, tmp_path):
    """A tiny DeepSeek-V4 (transformers' format) or V4.1 (DeepInfer's release format)."""
    if request.param == "v4":
        return _checkpoint(make_checkpoint)
    return build_v41_checkpoint(tmp_path / "v41")


def test_prompt_chunks_and_decodes_match_transformers(make_checkpoint, hf_model_loader):
    path = _checkpoint(make_checkpoint)
    ours, hf = PagedModel(path, attention="torch"), hf_model_loader(path)
    kinds = [layer.attn.kind for layer in ours.model.model.layers]
    assert kinds == DEEPSEEK_V4["layer_types"]
    a, b = _prompts(ours.config.vocab_size, [45, 29])
    first = ours.step([(0, a[:14], 0), (1, b, 0)])  # a chunk of a, all of b
    torch.testing.assert_close(first[14:], _hf_logits(hf, b), atol=2e-5, rtol=1e-4)
    second = ours.step([(0, a[14:37], 14)])         # a continuation over its cached context
    rest = [ours.step([(0, a[i:i + 1], i)]) for i in range(37, 45)]  # decodes
    got = torch.cat([first[:14], second, *rest])
    torch.testing.assert_close(got, _hf_logits(hf, a), atol=2e-5, rtol=1e-4)


def test_indexer_top_k_selection_matches_transformers(make_checkpoint, hf_model_loader):
    """index_topk 3 of up to 11 entries: the indexer's choice decides what each query sees.
    A score is a sum of per-head ReLUs, so it is exactly 0 wherever every head's is, and
    among tied entries transformers' top-k keeps whichever its kernel happens to (its cached
    generate and its no-cache forward disagree there), where openinfer keeps the earliest (the
    same in every chunking). With 8 indexer heads an all-zero score is rare, and no tie
    reaches the top 3 for these prompts."""
    path = _checkpoint(make_checkpoint, index_topk=3, index_n_heads=8)
    ours, hf = PagedModel(path, attention="torch"), hf_model_loader(path)
    # (With seed 1, one of 86 queries has two entries tied at score 0 for its third place.)
    prompts = _prompts(ours.config.vocab_size, [45, 29, 12], seed=2)
    logits = ours.step([(i, p, 0) for i, p in enumerate(prompts)])
    offset = 0
    for p in prompts:
        torch.testing.assert_close(logits[offset:offset + len(p)], _hf_logits(hf, p),
                                   atol=2e-5, rtol=1e-4)
        offset += len(p)


def test_engine_greedy_tokens_with_and_without_prefix_caching(make_checkpoint, hf_model_loader):
    path = _checkpoint(make_checkpoint)
    hf = hf_model_loader(path)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    options = dict(block_size=4, max_num_batched_tokens=16, window_snapshot_interval=16, progress=False)
    prompts = _prompts(1000, [37, 5, 26], seed=3)
    llm = LLM(str(path), **options)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for prompt, tokens in zip(prompts, outs):  # transformers' argmax after each prefix
        want = _hf_logits(hf, prompt + tokens)[len(prompt) - 1:-1].argmax(-1).tolist()
        assert tokens == want
    # Hits at and behind snapshots: the same prompts, and prompts that share part of them.
    again = llm.generate(prompts + [prompts[0][:30] + [5, 6, 7]], params)
    assert [o.outputs[0].token_ids for o in again[:3]] == outs
    assert again[0].num_cached_tokens > 0
    plain = LLM(str(path), enable_prefix_caching=False, **options)
    expected = plain.generate([prompts[0][:30] + [5, 6, 7]], params)[0].outputs[0].token_ids
    assert again[3].outputs[0].token_ids == expected
    llm.engine.check_integrity()


def test_file_store_restart_gives_the_same_tokens(v4_family, tmp_path):
    """Every slot (window keys, raw rows, entries, index keys) of a block goes to the file
    store with it; a cold engine resumes from there."""
    path = v4_family
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    options = dict(block_size=4, max_num_batched_tokens=16, progress=False)
    prompts = _prompts(1000, [41, 30], seed=8)
    expected = [o.outputs[0].token_ids for o in
                LLM(str(path), enable_prefix_caching=False, **options).generate(prompts, params)]
    store = str(tmp_path / "store")
    writer = LLM(str(path), kv_store_dir=store, **options)
    assert [o.outputs[0].token_ids for o in writer.generate(prompts, params)] == expected
    writer.engine.core.shutdown()
    reader = LLM(str(path), kv_store_dir=store, **options)
    assert [o.outputs[0].token_ids for o in reader.generate(prompts, params)] == expected
    assert reader.engine.core.kv.hit_tokens_by_tier["L3"] > 0
    reader.engine.core.shutdown()


def test_rolled_back_tokens_leave_no_trace(make_checkpoint):
    """Speculative tokens computed and then rejected: running other tokens at their positions
    rewrites the window keys, raw compressor rows and the entries they completed (a CSA and
    an HCA group end inside them), so the logits equal a run that never saw them."""
    path = _checkpoint(make_checkpoint)
    base, drafted, accepted = _prompts(1000, [29, 5, 5], seed=4)
    spec = PagedModel(path, attention="torch")
    spec.step([(0, base, 0)])
    spec.step([(0, drafted, 29)])  # positions 29..33: groups end at 31 (CSA) and 31 (HCA)
    got = spec.step([(0, accepted, 29)])
    fresh = PagedModel(path, attention="torch")
    want = fresh.step([(0, base + accepted, 0)])[29:]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_bfloat16_is_as_close_to_the_exact_answer_as_transformers(make_checkpoint, hf_model_loader):
    """A bf16 checkpoint: transformers in float32 computes its exact answer. openinfer in bf16
    keeps the same parameters in float32 as the reference (norms, hyper-connections, sinks,
    gate biases, position biases) and is, on average, as close to it as transformers' bf16."""
    path = make_checkpoint("DeepseekV4ForCausalLM", extra_config=DEEPSEEK_V4, num_layers=4, num_heads=4,
                           num_kv_heads=1, head_dim=32, intermediate_size=32, dtype=torch.bfloat16)
    randomize_v4(path)
    ours, truth = PagedModel(path, dtype="bfloat16", attention="torch"), hf_model_loader(path)
    theirs = type(truth).from_pretrained(path, dtype=torch.bfloat16).eval()
    fp32 = {n for n, p in ours.model.named_parameters() if p.dtype == torch.float32}
    assert fp32 and all(n.endswith(("norm.weight", "_fn", "_base", "_scale", ".fn", ".base", ".scale",
                                    "attn_sink", ".ape", "gate.bias")) for n in fp32)
    prompts = _prompts(ours.config.vocab_size, [33, 20])
    logits = ours.step([(i, p, 0) for i, p in enumerate(prompts)])
    offset = 0
    for p in prompts:
        got, want = logits[offset:offset + len(p)], _hf_logits(truth, p)
        offset += len(p)
        their_error = (_hf_logits(theirs, p) - want).abs().mean().item()
        assert (got - want).abs().mean().item() <= 1.5 * their_error + 1e-3


def test_disaggregated_prefill_and_decode(v4_family):
    """Every slot of a block crosses from the prefill instance to the decode instance."""
    path = v4_family
    prompts = _prompts(1000, [41, 26], seed=9)
    params = dict(temperature=0, max_tokens=6, ignore_eos=True)
    options = dict(block_size=4, max_num_batched_tokens=16)
    expected = [o.outputs[0].token_ids for o in
                LLM(str(path), enable_prefix_caching=False, progress=False, **options)
                .generate(prompts, SamplingParams(**params))]
    tokens, _, decode = run_disaggregated(path, prompts, params, **options)
    assert tokens == expected
    assert decode.engine.core.scheduler.num_remote_blocks_pulled == 10 + 6


def test_speculative_decoding_keeps_greedy_tokens(v4_family):
    """n-gram drafts over the window, compressor and indexer caches: rejected drafts complete
    compression groups that the accepted tokens complete again, and tokens equal plain
    decoding's."""
    path = v4_family
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = _prompts(1000, [37, 12], seed=6)
    prompts[1] = prompts[1] * 3
    expected = [o.outputs[0].token_ids for o in LLM(str(path), progress=False).generate(prompts, params)]
    llm = LLM(str(path), progress=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.core.stats()["spec_num_draft_tokens"] > 0
    llm.engine.check_integrity()


def test_a_step_of_many_sequences_gives_each_the_logits_of_its_own_steps(v4_family):
    """A step's sequences attend in padded batches (its decodes together, its prefill chunks
    in groups of similar length, padded to the longest): every sequence's logits are those
    of steps that hold it alone, in V4 and V4.1 (whose consumers reuse the index source's
    per-row choices and candidate blocks)."""
    lengths = [40, 7, 23, 33, 3, 18]
    first = [20, 6, 23, 10, 2, 17]  # then: decodes of 1, 4, 5; continuations of 0 and 3
    prompts = _prompts(1000, lengths, seed=4)
    together = PagedModel(v4_family, attention="torch", dtype="float32")
    step1 = together.step([(i, p[:c], 0) for i, (p, c) in enumerate(zip(prompts, first))])
    order = [1, 4, 5, 0, 3]  # decodes first
    step2 = together.step([(i, prompts[i][first[i]:], first[i]) for i in order])
    alone = PagedModel(v4_family, attention="torch", dtype="float32")
    offset = 0
    for i, (p, c) in enumerate(zip(prompts, first)):
        torch.testing.assert_close(step1[offset:offset + c], alone.step([(i, p[:c], 0)]),
                                   atol=1e-5, rtol=1e-5)
        offset += c
    offset = 0
    for i in order:
        rest = prompts[i][first[i]:]
        torch.testing.assert_close(step2[offset:offset + len(rest)], alone.step([(i, rest, first[i])]),
                                   atol=1e-5, rtol=1e-5)
        offset += len(rest)


def test_a_step_is_batched_in_groups_that_at_most_double_a_chunk():
    """Decodes in one batch; prefill chunks longest first, a new group wherever a chunk is
    under half its group's longest; padding repeats a sequence's last row and position, and
    only real queries are written back."""
    from openinfer.attention.base import build_attention_metadata
    from openinfer.attention.compressed import step_batches
    from openinfer.attention.reference import TorchAttentionBackend

    query_lens = [1, 1, 12, 40, 0, 25, 19, 3]
    seq_lens = [9, 5, 12, 60, 4, 25, 30, 3]
    meta = build_attention_metadata(TorchAttentionBackend(), query_lens, seq_lens,
                                    [[i] * 16 for i in range(8)], 4)
    batches = step_batches(meta)
    assert [b.seqs.tolist() for b in batches] == [[0, 1], [3, 5], [6, 2], [7]]
    assert step_batches(meta) is batches  # once per step
    starts = [0, 1, 2, 14, 54, 54, 79, 98]
    for batch in batches:
        for p, b in enumerate(batch.seqs.tolist()):
            n = query_lens[b]
            assert batch.rows[p, :n].tolist() == list(range(starts[b], starts[b] + n))
            assert batch.positions[p, :n].tolist() == list(range(seq_lens[b] - n, seq_lens[b]))
            assert not batch.valid[p, n:].any() and (batch.rows[p, n:] == starts[b] + n - 1).all()
        assert batch.rows.flatten()[batch.take].tolist() == batch.to_rows.tolist()
    assert sorted(r for b in batches for r in b.to_rows.tolist()) == list(range(sum(query_lens)))
