"""A model whose layers fall into two KV layer groups: one tensor and one block table per
group, and every path that moves a block (prefix hits, host tier, file store, KV
transfer) handles both groups through the block layout, giving the single-group tokens."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from conftest import run_disaggregated

from openinfer import LLM, SamplingParams
from openinfer.kv.spec import FullAttentionSpec
from openinfer.models.llama import LlamaForCausalLM

MiB = 1024**2
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@dataclass(frozen=True)
class TaggedSpec(FullAttentionSpec):
    """Full attention whose ``tag`` keeps otherwise equal layers in separate groups."""
    tag: int = 0


def two_groups(self, block_size: int, dtype: str):
    """Even layers in one group, odd layers in another."""
    return [TaggedSpec(block_size, layer.self_attn.num_kv_heads, layer.self_attn.head_dim,
                       dtype, tag=i % 2) for i, layer in enumerate(self.model.layers)]


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(n)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def expected(qwen3_checkpoint) -> dict:
    """Single-group tokens for the prompts below."""
    llm = LLM(str(qwen3_checkpoint), enable_prefix_caching=False, progress=False,
              kv_cache_memory=32 * MiB)
    prompts = _prompts(3, 70, seed=5)
    return {"prompts": prompts, "tokens": _tokens(llm.generate(prompts, GREEDY))}


def test_two_groups_serve_hits_and_tiers_with_single_group_tokens(qwen3_checkpoint, expected,
                                                                  tmp_path, monkeypatch):
    monkeypatch.setattr(LlamaForCausalLM, "kv_cache_specs", two_groups)
    prompts, tokens = expected["prompts"], expected["tokens"]
    store = tmp_path / "store"
    llm = LLM(str(qwen3_checkpoint), progress=False, kv_cache_memory=32 * MiB,
              kv_host_memory=16 * MiB, kv_store_dir=str(store))
    core = llm.engine.core
    assert len(core.kv.groups) == 2 and len(core.executor.worker.kv_caches) == 2
    assert _tokens(llm.generate(prompts, GREEDY)) == tokens
    again = llm.generate(prompts, GREEDY)                      # L1 hits in both groups
    assert _tokens(again) == tokens and all(o.num_cached_tokens == 64 for o in again)
    core.reset_prefix_cache()                                  # L1 and L2 forgotten
    core.connector.drain_file_io()
    from_store = llm.generate(prompts, GREEDY)                 # L3 -> L2 -> L1
    assert _tokens(from_store) == tokens and all(o.num_cached_tokens == 64 for o in from_store)
    assert core.kv.hit_tokens_by_tier["L3"] == 3 * 64
    layout = core.executor.worker.kv.mover.layout
    n = core.config.model.num_layers
    assert [g.layers for g in layout.groups] == [tuple(range(0, n, 2)), tuple(range(1, n, 2))]
    assert layout.block_bytes == sum(g.bytes_per_block for g in core.kv.groups)
    core.shutdown()


def test_a_store_written_under_another_layout_is_never_read(qwen3_checkpoint, expected,
                                                          tmp_path, monkeypatch):
    prompts, tokens = expected["prompts"], expected["tokens"]
    store = tmp_path / "store"
    one = LLM(str(qwen3_checkpoint), progress=False, kv_cache_memory=32 * MiB,
              kv_store_dir=str(store))
    one.generate(prompts, GREEDY)
    one.engine.core.shutdown()
    monkeypatch.setattr(LlamaForCausalLM, "kv_cache_specs", two_groups)
    two = LLM(str(qwen3_checkpoint), progress=False, kv_cache_memory=32 * MiB,
              kv_store_dir=str(store))
    outs = two.generate(prompts, GREEDY)
    assert _tokens(outs) == tokens
    mover = two.engine.core.executor.worker.kv.mover
    assert mover.store.num_deleted_bad > 0 and mover.stats.store_read_failures > 0
    assert two.engine.core.kv.hit_tokens_by_tier["L3"] == 0
    two.engine.core.shutdown()


def test_two_groups_move_between_prefill_and_decode(qwen3_checkpoint, expected, monkeypatch):
    monkeypatch.setattr(LlamaForCausalLM, "kv_cache_specs", two_groups)
    prompts, tokens = expected["prompts"], expected["tokens"]
    got, _, decode = run_disaggregated(qwen3_checkpoint, prompts,
                                       dict(temperature=0, max_tokens=6, ignore_eos=True),
                                       kv_cache_memory=32 * MiB)
    assert got == tokens
    assert decode.engine.core.scheduler.num_remote_blocks_pulled == 3 * 4
    assert decode.engine.core.scheduler.num_prompt_tokens_computed == 3 * (70 - 64)
