"""A DeepSeek-V3 (MLA latent cache + MoE) through the engine's fast paths: prefix hits, host
(L2) and file-store (L3) reloads and a 1P1D disaggregated run give the plain path's tokens,
with the latent blocks moved through the BlockLayout like any other spec."""

from __future__ import annotations

import pytest
from conftest import build_checkpoint, run_disaggregated
from test_kv_tiers import _prompts, _tokens

from openinfer import LLM, SamplingParams
from openinfer.kv.spec import MLALatentSpec

MiB = 1024**2
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
V3 = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, q_lora_rank=24,
          moe_intermediate_size=32, num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1,
          first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
          routed_scaling_factor=2.5)
BLOCK_BYTES = 16 * (32 + 16) * 4 * 2  # tokens x entry x fp32 x layers


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    return build_checkpoint(tmp_path_factory.mktemp("v3"), "DeepseekV3ForCausalLM", tokenizer,
                            num_kv_heads=4, extra_config=V3)


@pytest.fixture(scope="module")
def plain(checkpoint) -> LLM:
    return LLM(str(checkpoint), enable_prefix_caching=False, progress=False)


def test_latent_blocks_through_host_and_file_tiers(checkpoint, plain, tmp_path):
    prompts = _prompts(4, 70, seed=1)
    expected = _tokens(plain.generate(prompts, GREEDY))
    # L2: a device pool of 12 blocks; each 70-token prompt needs 5, so later prompts evict
    # earlier ones, whose latent blocks come back from host memory.
    llm = LLM(str(checkpoint), kv_cache_memory=12 * BLOCK_BYTES, max_model_len=96,
              kv_host_memory=4 * MiB, progress=False)
    core = llm.engine.core
    (group,) = core.kv.groups
    assert isinstance(group.spec, MLALatentSpec) and core.kv.num_blocks == 12
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    again = llm.generate(prompts, GREEDY)
    assert _tokens(again) == expected and all(o.num_cached_tokens == 64 for o in again)
    assert core.kv.hit_tokens_by_tier["L2"] > 0
    core.check_integrity()
    # L3: one engine writes the store, a cold one reads it.
    store = tmp_path / "store"
    writer = LLM(str(checkpoint), kv_store_dir=str(store), progress=False)
    assert _tokens(writer.generate(prompts[:3], GREEDY)) == expected[:3]
    writer.engine.core.shutdown()
    reader = LLM(str(checkpoint), kv_store_dir=str(store), progress=False)
    outs = reader.generate(prompts[:3], GREEDY)
    assert _tokens(outs) == expected[:3]
    assert reader.engine.core.kv.hit_tokens_by_tier["L3"] == 3 * 64
    reader.engine.core.shutdown()


def test_disaggregated_prefill_and_decode(checkpoint, plain):
    prompts = _prompts(3, 100, seed=2)
    params = dict(temperature=0, max_tokens=8, ignore_eos=True)
    expected = _tokens(plain.generate(prompts, SamplingParams(**params)))
    tokens, _, decode = run_disaggregated(checkpoint, prompts, params, kv_cache_memory=32 * MiB)
    assert tokens == expected
    core = decode.engine.core
    assert core.scheduler.num_remote_blocks_pulled == 3 * 6
    assert core.executor.worker.kv.mover.stats.bytes["remote_to_host"] == 18 * BLOCK_BYTES


@pytest.mark.slow
def test_openinfer_serve_answers_the_official_client(checkpoint, plain):
    import sys
    from pathlib import Path

    import openai

    sys.path.insert(0, str(Path(__file__).parent.parent / "e2e"))
    from server_process import MODEL, start_server

    base, proc = start_server(checkpoint)
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        prompt = _prompts(1, 30, seed=3)[0]
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        (expected,) = plain.generate([prompt], GREEDY)
        assert done.choices[0].text == expected.outputs[0].text
        chat = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0,
                                              messages=[{"role": "user", "content": "Hello there"}])
        assert chat.choices[0].finish_reason in ("length", "stop")
        assert chat.usage.completion_tokens >= 1 and chat.usage.prompt_tokens > 3
    finally:
        proc.terminate()
        proc.wait(timeout=60)
