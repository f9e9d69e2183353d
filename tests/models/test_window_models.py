"""Sliding-window models match transformers (prompt, chunked and decode logits; greedy tokens
through the engine), and the engine holds O(window) KV for their window layers while prefix
hits stay exact."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from attention_support import ATTENTION_BACKENDS
from conftest import run_disaggregated
from test_hf_parity import PagedModel, _hf_logits, _prompts

from openinfer import LLM, SamplingParams
from openinfer.engine_args import create_engine_config
from openinfer.kv.spec import SKIPPED, page_bytes

WINDOW = 8
WINDOW_MODELS = {
    # Every layer windowed.
    "MistralForCausalLM": ("MistralForCausalLM", dict(sliding_window=WINDOW)),
    # Layer 0 full attention, layers 1-2 windowed: two layer groups.
    "Qwen3-layer-types": ("Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                   max_window_layers=1)),
    # Sliding / full / sliding, attention sinks, biased top-k experts with a clamped SwiGLU
    # (a small limit, so the clamps bite), YaRN RoPE.
    "GptOssForCausalLM": ("GptOssForCausalLM", dict(
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        num_local_experts=8, num_experts_per_tok=2, swiglu_limit=0.5)),
    # Sliding / full / sliding, soft-capped scores (a small cap, so it bites) and logits,
    # sandwich norms, gelu MLP, scale from query_pre_attn_scalar.
    "Gemma2ForCausalLM": ("Gemma2ForCausalLM", dict(
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, query_pre_attn_scalar=24)),
}
EXPECTED_WINDOWS = {"MistralForCausalLM": [WINDOW] * 3, "Qwen3-layer-types": [0, WINDOW, WINDOW],
                    "GptOssForCausalLM": [WINDOW, 0, WINDOW], "Gemma2ForCausalLM": [WINDOW, 0, WINDOW]}


def _checkpoint(make_checkpoint, name: str, **kwargs):
    arch, extra = WINDOW_MODELS[name]
    path = make_checkpoint(arch, extra_config=extra, num_layers=3, **kwargs)
    if arch == "GptOssForCausalLM":
        _perturb(path, ("sinks", "gate_up_proj_bias", "down_proj_bias"))
    return path


def _perturb(path, suffixes: tuple[str, ...]) -> None:
    """Random values, large enough to matter, for tensors transformers initialises to zero
    or near it (attention sinks, expert biases)."""
    from safetensors.torch import load_file, save_file

    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    g = torch.Generator().manual_seed(4)
    for name, t in tensors.items():
        if name.endswith(suffixes):
            tensors[name] = torch.randn(t.shape, generator=g)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("attention", ATTENTION_BACKENDS)
@pytest.mark.parametrize("name", list(WINDOW_MODELS))
def test_prefill_chunks_and_decodes_match_transformers(name, attention, make_checkpoint,
                                                       hf_model_loader):
    path = _checkpoint(make_checkpoint, name)
    ours, hf = PagedModel(path, attention=attention), hf_model_loader(path)
    windows = [layer.self_attn.attn.sliding_window for layer in ours.model.model.layers]
    assert windows == EXPECTED_WINDOWS[name]
    a, b = _prompts(ours.config.vocab_size, [30, 21])
    # a: a 13-token chunk, a 9-token continuation, then decodes; b: one prompt, longer than
    # the window, in the same first step.
    first = ours.step([(0, a[:13], 0), (1, b, 0)])
    second = ours.step([(0, a[13:22], 13)])
    rest = [ours.step([(0, a[i:i + 1], i)]) for i in range(22, 30)]
    torch.testing.assert_close(torch.cat([first[:13], second, *rest]), _hf_logits(hf, a),
                               atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(first[13:], _hf_logits(hf, b), atol=2e-5, rtol=1e-4)


def _teacher_forced_argmax(hf, tokens: list[int], num_prompt: int) -> list[int]:
    """transformers' greedy choice after each prefix of ``tokens`` (one no-cache forward)."""
    return _hf_logits(hf, tokens)[num_prompt - 1:-1].argmax(-1).tolist()


@pytest.mark.parametrize("name", list(WINDOW_MODELS))
def test_engine_holds_the_window_only_and_caching_changes_no_token(name, make_checkpoint,
                                                                    hf_model_loader):
    path = _checkpoint(make_checkpoint, name)
    hf = hf_model_loader(path)
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=16, progress=False)
    kv = llm.engine.core.kv
    assert {spec.window for _, spec in kv.windows} == {WINDOW}
    prompts = _prompts(llm.engine.inputs.vocab_size, [45, 3, 30], seed=5)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"r{i}", prompt, params)
    spec, live = kv.windows[0][1], []
    outputs = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        for rid in list(kv._tables):
            for g, _ in kv.windows:
                table = kv.block_table(rid)[g]
                live.append(sum(b != SKIPPED for b in table))
                assert len(table) == len(kv.block_table(rid)[0])
        llm.engine.check_integrity()
    assert max(live) <= spec.max_live_blocks(16)  # O(window + chunk), whatever the length
    for i, prompt in enumerate(prompts):
        tokens = outputs[f"r{i}"]
        assert tokens == _teacher_forced_argmax(hf, prompt + tokens, len(prompt))

    # The same prompts again: prefix hits (window pages included) give the same tokens.
    again = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in again] == [outputs[f"r{i}"] for i in range(3)]
    assert again[0].num_cached_tokens > 0
    uncached = LLM(str(path), block_size=4, max_num_batched_tokens=16, progress=False,
                   enable_prefix_caching=False)
    plain = uncached.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in plain] == [outputs[f"r{i}"] for i in range(3)]


@pytest.mark.parametrize("name", ["GptOssForCausalLM", "Qwen3-layer-types"])
def test_window_pages_through_host_and_file_tiers(name, make_checkpoint, tmp_path):
    """A device pool too small to keep earlier prompts: their blocks (window pages with
    them) come back from host memory, and a cold engine reads them from the file store."""
    path = _checkpoint(make_checkpoint, name)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = _prompts(1000, [70, 70, 70, 70], seed=2)
    options = dict(block_size=4, max_num_batched_tokens=32, max_model_len=96, progress=False)
    plain = LLM(str(path), enable_prefix_caching=False, **options)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    groups = plain.engine.core.kv.groups
    blocks_per_request = sum(g.spec.blocks_for(76) for g in groups)
    llm = LLM(str(path), kv_cache_memory=int(1.5 * blocks_per_request) * page_bytes(groups),
              kv_host_memory=8 * 1024**2, **options)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    again = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert llm.engine.core.kv.hit_tokens_by_tier["L2"] > 0
    llm.engine.check_integrity()
    store = tmp_path / "store"
    writer = LLM(str(path), kv_store_dir=str(store), **options)
    writer.generate(prompts[:2], params)
    writer.engine.core.shutdown()
    reader = LLM(str(path), kv_store_dir=str(store), **options)
    outs = reader.generate(prompts[:2], params)
    assert [o.outputs[0].token_ids for o in outs] == expected[:2]
    assert reader.engine.core.kv.hit_tokens_by_tier["L3"] > 0
    reader.engine.core.shutdown()


def test_disaggregated_prefill_and_decode_carry_the_window(make_checkpoint):
    """A prefill instance keeps its window layers' blocks whole (it lends them); the decode
    instance pulls every block with its window pages and decodes as a colocated run does."""
    path = _checkpoint(make_checkpoint, "GptOssForCausalLM")
    prompts = _prompts(1000, [45, 30], seed=6)
    params = dict(temperature=0, max_tokens=6, ignore_eos=True)
    options = dict(block_size=4, max_num_batched_tokens=16, progress=False)
    expected = [o.outputs[0].token_ids for o in LLM(str(path), enable_prefix_caching=False, **options)
                .generate(prompts, SamplingParams(**params))]
    tokens, prefill, decode = run_disaggregated(path, prompts, params, block_size=4,
                                                max_num_batched_tokens=16)
    assert tokens == expected
    assert prefill.engine.core.kv.lends_windows
    assert decode.engine.core.scheduler.num_remote_blocks_pulled == 11 + 7


def test_window_only_models_keep_their_cache_on_the_device(make_checkpoint):
    mistral = _checkpoint(make_checkpoint, "MistralForCausalLM")
    with pytest.raises(ValueError, match="sliding-window layers only"):
        LLM(str(mistral), kv_host_memory=1 << 20, progress=False)
    with pytest.raises(ValueError, match="sliding-window layers only"):
        LLM(str(mistral), kv_role="prefill", progress=False)


@pytest.mark.parametrize("option,value,named", [
    ("kv_host_memory", 1 << 20, "kv_host_memory (--kv-host-memory)"),
    ("kv_store_dir", "/tmp/unused-store", "kv_store_dir (--kv-store-dir)"),
    ("kv_role", "decode", "kv_role 'decode' (--role)"),
    ("kv_transfer_port", 7100, "kv_transfer_port (--kv-transfer-port)")])
def test_window_only_models_are_refused_off_device_kv_by_the_config(make_checkpoint, option,
                                                                    value, named):
    """At config time, in one line naming the option (a server exits with it, instead of an
    engine core's traceback); a model with a full-attention layer is not refused."""
    mistral = _checkpoint(make_checkpoint, "MistralForCausalLM")
    with pytest.raises(ValueError) as refused:
        create_engine_config(str(mistral), **{option: value})
    message = str(refused.value)
    assert message.startswith(f"{named}: MistralForCausalLM has sliding-window layers only")
    assert "\n" not in message
    qwen3 = _checkpoint(make_checkpoint, "Qwen3-layer-types")
    create_engine_config(str(qwen3), **{option: value})


def test_serve_refuses_host_memory_for_a_window_only_model_in_one_line(make_checkpoint):
    mistral = _checkpoint(make_checkpoint, "MistralForCausalLM")
    res = subprocess.run([sys.executable, "-m", "openinfer", "serve", "--model", str(mistral),
                          "--port", "0", "--kv-host-memory", "8MiB"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "openinfer: error: kv_host_memory (--kv-host-memory): MistralForCausalLM has " \
           "sliding-window layers only" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("bounded", [True, False], ids=["bounded-replay", "per-block-pages"])
def test_hits_across_a_snapshot_interval_give_the_recomputed_tokens(bounded, make_checkpoint):
    """Prompts that share 17..47 tokens with a cached one hit at every offset of a 16-token
    snapshot interval: with window snapshots they resume at the latest snapshot and recompute
    the rest, with per-block window pages at the full hit; both give the uncached tokens."""
    path = _checkpoint(make_checkpoint, "GptOssForCausalLM")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    options = dict(block_size=4, max_num_batched_tokens=16, progress=False)
    base = _prompts(1000, [48], seed=9)[0]
    prompts = [base[:k] + [7, 11, 13] for k in (17, 22, 29, 33, 38, 47)]
    plain = LLM(str(path), enable_prefix_caching=False, **options)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = LLM(str(path), window_snapshots=bounded, window_snapshot_interval=16, **options)
    llm.generate([base], params)
    for prompt, want in zip(prompts, expected):  # one by one: each finds only the base cached
        out = llm.generate([prompt], params)[0]
        assert out.outputs[0].token_ids == want
        assert out.num_cached_tokens >= 16
    stats = llm.engine.core.stats()
    assert (stats["window_replayed_tokens"] > 0) == bounded
    llm.engine.check_integrity()


def test_preempted_requests_resume_with_the_same_tokens(make_checkpoint):
    """A pool too small for every running request: the newest are preempted (their window
    and full blocks freed), recomputed later from their cached prefix, and end as they would
    have alone."""
    path = _checkpoint(make_checkpoint, "GptOssForCausalLM")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = _prompts(1000, [40, 36, 44, 30], seed=12)
    options = dict(block_size=4, max_num_batched_tokens=32, max_model_len=80, progress=False)
    plain = LLM(str(path), enable_prefix_caching=False, **options)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    groups = plain.engine.core.kv.groups
    one_request = sum(g.spec.blocks_for(70) for g in groups)
    llm = LLM(str(path), kv_cache_memory=one_request * page_bytes(groups), **options)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.core.stats()["num_preemptions"] > 0
    llm.engine.check_integrity()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_rolls_back_window_pages(method, make_checkpoint):
    """Drafts verified and rejected across window releases (window 8, blocks of 4): the
    window groups' tables shorten with the full groups', and greedy tokens equal plain
    decoding's. The draft model is the target itself (its window layers in groups of their
    own), so runs are accepted whole; n-gram drafts are mostly rejected."""
    path = _checkpoint(make_checkpoint, "GptOssForCausalLM")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = _prompts(1000, [30, 9, 21], seed=13)
    prompts[1] = prompts[1] * 3  # something to look up
    options = dict(block_size=4, max_model_len=96, progress=False)
    expected = [o.outputs[0].token_ids for o in LLM(str(path), **options).generate(prompts, params)]
    extra = {"model": str(path)} if method == "draft_model" else {}
    llm = LLM(str(path), **options, speculative_config={
        "method": method, "num_speculative_tokens": 3, **extra})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.engine.core.stats()
    assert stats["spec_num_draft_tokens"] > 0
    if method == "draft_model":
        assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]
    llm.engine.check_integrity()
