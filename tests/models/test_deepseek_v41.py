"""DeepSeek-V4.1 (DeepInfer's model) from a checkpoint in DeepInfer's release format: the
engine's paged, chunked, batched forward gives the plain float64 reference's logits
(tests/v41_reference.py: one sequence, no cache, everything recomputed), and its
greedy tokens with and without prefix hits. Window, C2 and C1 layers; a KV source, layers
reading its entries, index keys or top-k choice; the YOCO consumers' shared hidden state;
candidate blocks; shifted hyper-connections; Engram's hashed n-grams (reaching back across steps and prefix
hits); FP8 projections and MXFP4 experts as stored. The file store,
disaggregation and speculation run in tests/models/test_deepseek_v4.py (``v4_family``)."""

from __future__ import annotations

import json

import pytest
import torch
from test_hf_parity import PagedModel, _prompts
from v41_checkpoint import TEXT, _compressed_ids, build_v41_checkpoint, v41_config
from v41_reference import V41Reference

from openinfer import LLM, SamplingParams
from openinfer.config import ModelConfig
from openinfer.kv.spec import page_bytes
from openinfer.models.arch import ArchConfig
from openinfer.models.engram import compressed_vocabulary
from openinfer.models.v41_replay import REPLAY_ROWS_ENV


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    return build_v41_checkpoint(tmp_path_factory.mktemp("v41"))


def test_prompt_chunks_and_decodes_match_the_reference(v41):
    ours, ref = PagedModel(v41, attention="torch", dtype="float32"), V41Reference(v41)
    assert ours.config.architecture == "DeepseekV41ForCausalLM"
    assert ours.model.layers[0].engram.embed.weight.dtype == torch.float8_e4m3fn  # kept as stored
    a, b = _prompts(ours.config.vocab_size, [45, 29])
    first = ours.step([(0, a[:14], 0), (1, b, 0)])  # a chunk of a (odd length: a C2 pair split), all of b
    torch.testing.assert_close(first[14:], ref.logits(b).float(), atol=2e-5, rtol=1e-4)
    second = ours.step([(0, a[14:37], 14)])         # a continuation over its cached context
    rest = [ours.step([(0, a[i:i + 1], i)]) for i in range(37, 45)]  # decodes
    got = torch.cat([first[:14], second, *rest])
    torch.testing.assert_close(got, ref.logits(a).float(), atol=2e-5, rtol=1e-4)


def test_the_reference_exercises_every_part(v41):
    """The check above means something: top-k drops entries in every compressed layer, and
    computing the consumers' entries from their own hidden state, a layer's index keys from
    its source's, or leaving Engram, the vocabulary's compression or the candidate blocks
    out changes the answer."""
    ref = V41Reference(v41)
    prompt = _prompts(1024, [40], seed=5)[0]
    want = ref.logits(prompt)
    for layer in range(1, 7):
        last_visible = len(prompt) // TEXT["compress_ratios"][layer]
        assert len(ref.state[layer]["choice"][-1]) == TEXT["index_topk"] < last_visible
    changes = {"every entry chosen": lambda r: r.cfg.update(index_topk=10_000),
               "consumers' own hidden states": lambda r: setattr(r, "first_consumer", 99),
               "layer 4 reading layer 3's index keys": lambda r: r.ik_src.__setitem__(4, 3),
               "no Engram": lambda r: r.cfg.update(engram_layer_ids=[]),
               "no candidate blocks": lambda r: r.cfg.update(candidate_source_layer_id=None),
               "an uncompressed vocabulary": lambda r: setattr(r, "compressed", list(range(1024)))}
    for what, change in changes.items():
        other = V41Reference(v41)
        change(other)
        assert (other.logits(prompt) - want).abs().max() > 1e-3, what


def test_engine_greedy_tokens_match_the_reference_with_and_without_prefix_caching(v41):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    options = dict(block_size=4, max_num_batched_tokens=16, window_snapshot_interval=16,
                   dtype="float32", progress=False)
    prompts = _prompts(1024, [37, 5, 26], seed=3)
    llm = LLM(str(v41), **options)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    ref = V41Reference(v41)
    for prompt, tokens in zip(prompts, outs, strict=True):  # the reference's argmax after each prefix
        assert tokens == ref.logits(prompt + tokens)[len(prompt) - 1:-1].argmax(-1).tolist()
    again = llm.generate(prompts + [prompts[0][:30] + [5, 6, 7]], params)
    assert [o.outputs[0].token_ids for o in again[:3]] == outs
    assert again[0].num_cached_tokens > 0 and again[3].num_cached_tokens > 0
    plain = LLM(str(v41), enable_prefix_caching=False, **options)
    assert again[3].outputs[0].token_ids == \
        plain.generate([prompts[0][:30] + [5, 6, 7]], params)[0].outputs[0].token_ids
    llm.engine.check_integrity()


def test_bfloat16_stays_near_the_exact_answer(tmp_path):
    """bf16 compute (mHC, norms, sinks, gate biases kept in float32): the mean error against
    the float64 reference stays a small fraction of the logits' spread (2% measured) and the
    top tokens agree. Measured with every entry chosen: top-k is discontinuous, so near a tie
    a bf16-rounded score picks another entry (with index_topk 4 the error is 11%, all of it
    after the first flip; DeepInfer scores in FP4, further still); no candidate blocks, for
    the same reason. float32 is within 2e-5."""
    path = build_v41_checkpoint(tmp_path / "v41", index_topk=10_000, candidate_source_layer_id=None)
    ours = PagedModel(path, attention="torch", dtype="bfloat16")
    prompt = _prompts(1024, [33], seed=7)[0]
    got, want = ours.step([(0, prompt, 0)]).double(), V41Reference(path).logits(prompt)
    assert (got - want).abs().mean() < 0.04 * want.std()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("change, message", [
    (dict(engram_compressed_vocab_size=None), "engram_compressed_vocab_size"),
    (dict(candidate_source_layer_id=2), "every layer from candidate_source_layer_id 2"),
    (dict(candidate_source_layer_id=6), "candidate_source_layer_id 6 is not an index source"),
    (dict(candidate_topk_blocks=4), "a multiple of 8"),
    (dict(scoring_func="sigmoid"), "scoring_func"),
    (dict(compress_ratios=[0, 2, 2, 0, 0, 0, 0, 0]), "no ratio-1 layer"),
    (dict(compress_ratios=[0, 2, 2, 1, 2, 1, 1, 0]), "ratio-2 layer after"),
    (dict(compress_ratios=[0, 2, 1, 1]), "num_hidden_layers"),
    (dict(kv_source_layer_ids=[1, 4]), "makes layer 3 .* read layer 1's"),  # across the split
    (dict(index_k_source_layer_ids=[1, 3, 4]), "every KV source must be an index-K source"),
    (dict(kv_source_layer_ids=[0, 3]), "only a compressed layer of the same ratio"),
])
def test_configs_it_cannot_serve_are_refused_by_name(tmp_path, change, message):
    (tmp_path / "config.json").write_text(json.dumps(v41_config(**change)))
    config = ModelConfig.from_pretrained(tmp_path, dtype="float32")
    with pytest.raises(ValueError, match=message):
        ArchConfig.from_hf(config.hf_config, source_dir=str(tmp_path)).deepseek_v41()


def test_the_release_config_reads_as_deepinfer_reads_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(v41_config()))
    config = ModelConfig.from_pretrained(tmp_path)
    arch = ArchConfig.from_hf(config.hf_config, source_dir=str(tmp_path))
    v41 = arch.deepseek_v41()
    assert (arch.num_layers, arch.num_heads, arch.head_dim, config.eos_token_ids) == (7, 4, 32, (1,))
    assert v41.first_consumer == 3 and v41.compress_ratios == (0, 2, 2, 1, 1, 1, 1)
    assert v41.kv_source == (0, 1, 1, 3, 3, 5, 5)
    assert v41.index_k_source == (0, 1, 1, 3, 4, 5, 5)
    assert v41.index_source == (0, 1, 2, 3, 4, 5, 5)
    assert v41.engram.layer_ids == (0, 2) and v41.engram.max_ngram == 3
    assert config.dtype in (torch.float32, torch.bfloat16)  # "dtype": "bfloat16", as this CPU runs it


@pytest.mark.parametrize("inter", [32, 64])
def test_two_ranks_give_the_tokens_and_logprobs_of_one(tmp_path, inter):
    """Heads, sinks and output groups split over two ranks (the one K = V head, entries and
    indexers whole on each); fp8 projections sliced by rows or columns as loaded; MXFP4
    experts multiplied out where a rank's 16 intermediate features are no run of 32, kept as
    loaded (each rank its 32) where they are."""
    v41 = build_v41_checkpoint(tmp_path / "v41", moe_intermediate_size=inter)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = _prompts(1024, [5, 37, 12], seed=7)
    options = dict(progress=False, max_num_batched_tokens=24, dtype="float32")
    expected = LLM(str(v41), **options).generate(prompts, params)
    two = LLM(str(v41), tensor_parallel_size=2, **options)
    try:
        labels = two.engine.core.executor.collective_rpc("compute_info_labels")
        assert [info["experts"] for info in labels] == ["cpu+fp4" if inter == 64 else "cpu"] * 2
        for want, got in zip(expected, two.generate(prompts, params), strict=True):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            for step_want, step_got in zip(want.outputs[0].logprobs, got.outputs[0].logprobs, strict=True):
                for token, lp in step_want.items():
                    assert step_got[token].logprob == pytest.approx(lp.logprob, abs=1e-4)
    finally:
        two.engine.core.shutdown()


def test_the_compressed_vocabulary_folds_case_accents_and_spacing(v41):
    """Engram's n-grams are of compressed tokens: the engine's table (tokenizers' normalizers,
    as DeepInfer builds it) is the reference's (unicodedata), and it merges ids."""
    table = compressed_vocabulary(str(v41 / "tokenizer.json"))
    assert table == _compressed_ids(v41 / "tokenizer.json")
    assert len(set(table)) < len(table)


def _replay_runs(path, monkeypatch, prompts, params, **options):
    """(outputs with bounded replay off, outputs and engine with it on)."""
    runs = []
    for rows in ("0", ""):
        monkeypatch.setenv(REPLAY_ROWS_ENV, rows)
        llm = LLM(str(path), block_size=4, dtype="float32", progress=False, **options)
        runs.append((llm.generate(prompts, params), llm))
    return runs[0][0], runs[1][0], runs[1][1]


def _assert_same(plain, replayed) -> None:
    for want, got in zip(plain, replayed, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for step_want, step_got in zip(want.outputs[0].logprobs, got.outputs[0].logprobs, strict=True):
            for token, lp in step_want.items():
                assert step_got[token].logprob == pytest.approx(lp.logprob, abs=1e-5)


@pytest.mark.parametrize("chunk", [16, 48])
def test_bounded_replay_gives_the_logprobs_of_every_row(v41, monkeypatch, chunk):
    """The consumers compute only each prefill's last rows (the last one its last window, each
    before it a window more): the sampled tokens' logprobs equal a run computing every row,
    whatever the chunking, with decodes and prefills in one step."""
    prompts = _prompts(1024, [60, 37, 9, 50], seed=11)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    plain, replayed, llm = _replay_runs(v41, monkeypatch, prompts, params,
                                        max_num_batched_tokens=chunk, enable_prefix_caching=False)
    _assert_same(plain, replayed)
    model = llm.engine.core.executor.worker.model
    assert model.replay_rows == {3: 13, 4: 10, 5: 7, 6: 4}  # window 4: 4 + 3 per layer behind
    assert model.num_rows_skipped > 0


def test_bounded_replay_with_prefix_hits_and_preemption(v41, monkeypatch):
    """A returning conversation hits up to its last turn (the consumers' windows there were
    computed); a prompt sharing only the start of a longer one resumes where its own last
    rows begin (the longer one's consumers never computed that far back); a pool too small
    for every request preempts and recomputes. Tokens and logprobs as with every row."""
    first = _prompts(1024, [70], seed=12)[0]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    monkeypatch.setenv(REPLAY_ROWS_ENV, "")
    llm = LLM(str(v41), block_size=4, dtype="float32", progress=False, max_num_batched_tokens=32,
              window_snapshot_interval=16)
    reply = llm.generate([first], params)[0].outputs[0].token_ids
    turn = first + reply + [7, 8, 9, 10, 11, 12]
    shared = first[:40] + [13, 14, 15, 16, 17]
    again = llm.generate([turn, shared], params)
    assert again[0].num_cached_tokens >= 72 and again[1].num_cached_tokens > 0
    monkeypatch.setenv(REPLAY_ROWS_ENV, "0")
    plain = LLM(str(v41), block_size=4, dtype="float32", progress=False, enable_prefix_caching=False)
    _assert_same(plain.generate([turn, shared], params), again)
    llm.engine.check_integrity()

    prompts = _prompts(1024, [60, 55, 50, 45], seed=13)
    page = llm.engine.core.kv.num_blocks and page_bytes(llm.engine.core.kv.groups)
    plain_out, replayed, small = _replay_runs(v41, monkeypatch, prompts, params, kv_cache_memory=240 * page,
                                              max_model_len=72, max_num_batched_tokens=32)
    _assert_same(plain_out, replayed)
    assert small.engine.core.scheduler.num_preemptions > 0


def test_every_weight_multiplied_out_gives_the_same_logits(v41, monkeypatch):
    """OPENINFER_FP8_WEIGHTS=dequantize (what --batch-invariant does): the fp8 projections,
    the MXFP4 experts and the Engram tables' fp8 rows (a scale per 32 of a row, not a tile)
    multiplied out at load compute what the kept ones do."""
    prompt = _prompts(1024, [30], seed=9)[0]
    kept = PagedModel(v41, attention="torch", dtype="float32").step([(0, prompt, 0)])
    monkeypatch.setenv("OPENINFER_FP8_WEIGHTS", "dequantize")
    dense = PagedModel(v41, attention="torch", dtype="float32")
    assert dense.model.layers[0].engram.embed.weight.dtype == torch.float32
    torch.testing.assert_close(dense.step([(0, prompt, 0)]), kept, atol=2e-5, rtol=1e-4)
