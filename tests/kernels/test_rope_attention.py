"""One C++ call per attention layer (``RopeAttention``): the cpu backend's ``forward_qkv``
gives the bits of the layer's separate steps (split, q/k norm, RoPE, K/V write, paged
attention) in the output and in the cache, for every sequence kind of a step; the layers it
does not cover take the separate steps."""

from __future__ import annotations

import pytest
import torch

from openinfer.attention import select_attention_backend
from openinfer.kernels.custom_op import Platform
from openinfer.layers.attention import Attention
from openinfer.layers.norm import RMSNorm
from openinfer.layers.rotary import RotaryEmbedding, get_rope
from openinfer.models.platform import bind_platform

HEADS, KV_HEADS, BLOCK, LAYERS, NUM_BLOCKS = 8, 2, 16, 3, 64


def _step(backend, query_lens: list[int], seq_lens: list[int]):
    """Metadata of a step (decodes first; distinct blocks per sequence) and its positions."""
    tables, next_block = [], 1
    for s in seq_lens:
        n = -(-s // BLOCK)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    meta = backend.build_metadata(query_lens, seq_lens, tables, BLOCK, "cpu")
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    return meta, positions


def _layer(kernels, head_dim: int, dtype: torch.dtype, qk_norm: bool, **variant):
    torch.manual_seed(3)
    attn = Attention(HEADS, KV_HEADS, head_dim, head_dim**-0.5, **variant).to(dtype)
    if attn.sinks is not None:
        attn.sinks.data.normal_()
    rotary = get_rope(head_dim, 4096, 10000.0, None)
    norms = (None, None)
    if qk_norm:
        norms = (RMSNorm(head_dim, 1e-6).to(dtype), RMSNorm(head_dim, 1e-6).to(dtype))
        for norm in norms:
            norm.weight.data.normal_(1.0, 0.2)
    for module in (rotary, *[n for n in norms if n is not None]):
        bind_platform(module, Platform("cpu", kernels))
    return attn, rotary, norms


def _run(attn: Attention, rotary: RotaryEmbedding, norms, qkv, positions, meta, blocks, fused: bool):
    attn.rope_kernels.clear()
    if not fused:
        attn.rope_kernels[qkv.dtype] = None  # the separate steps
    meta.derived.clear()
    cache = blocks[:, 1].transpose(0, 1)  # the engine's layout: a strided view of layer 1
    out = attn.forward_qkv(positions, qkv, rotary, cache, meta, *norms)
    assert (attn.rope_kernels[qkv.dtype] is not None) == fused
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "plain"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_one_call_gives_the_bits_of_the_separate_steps(kernels, dtype, qk_norm, head_dim):
    backend = select_attention_backend("cpu", "cpu")
    # Three decodes, a prompt from scratch, a chunked continuation / prefix hit.
    meta, positions = _step(backend, [1, 1, 1, 37, 20], [70, 1, 300, 37, 90])
    attn, rotary, norms = _layer(kernels, head_dim, dtype, qk_norm)
    qkv = (torch.randn(len(positions), (HEADS + 2 * KV_HEADS) * head_dim) * 3).to(dtype)
    blocks = torch.randn(NUM_BLOCKS, LAYERS, 2, BLOCK, KV_HEADS, head_dim).to(dtype)
    before = blocks.clone()
    split_blocks = blocks.clone()
    fused_out = _run(attn, rotary, norms, qkv, positions, meta, blocks, fused=True)
    split_out = _run(attn, rotary, norms, qkv, positions, meta, split_blocks, fused=False)
    assert fused_out.shape == (len(positions), HEADS * head_dim)
    assert torch.equal(fused_out, split_out)
    assert torch.equal(blocks, split_blocks)
    assert not torch.equal(blocks, before)  # the step's K/V were written


@pytest.mark.parametrize("variant", [dict(sliding_window=24), dict(logit_softcap=30.0),
                                     dict(sinks=True)], ids=["window", "softcap", "sinks"])
def test_variants_go_through_the_one_call(kernels, variant):
    backend = select_attention_backend("cpu", "cpu")
    meta, positions = _step(backend, [1, 1, 40], [100, 33, 60])
    attn, rotary, norms = _layer(kernels, 64, torch.float32, False, **variant)
    qkv = torch.randn(len(positions), (HEADS + 2 * KV_HEADS) * 64)
    blocks = torch.randn(NUM_BLOCKS, LAYERS, 2, BLOCK, KV_HEADS, 64)
    split_blocks = blocks.clone()
    fused_out = _run(attn, rotary, norms, qkv, positions, meta, blocks, fused=True)
    split_out = _run(attn, rotary, norms, qkv, positions, meta, split_blocks, fused=False)
    assert torch.equal(fused_out, split_out) and torch.equal(blocks, split_blocks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_float8_cache_through_the_one_call(kernels, dtype, cache_dtype):
    """--kv-cache-dtype fp8: the one call quantizes the step's K/V with the layer's scales and
    attends over the float8 cache, bit for bit the separate steps."""
    backend = select_attention_backend("cpu", "cpu")
    meta, positions = _step(backend, [1, 1, 40], [100, 33, 60])
    attn, rotary, norms = _layer(kernels, 64, dtype, True)
    attn.k_scale, attn.v_scale = 0.25, 2.0
    qkv = (torch.randn(len(positions), (HEADS + 2 * KV_HEADS) * 64) * 3).to(dtype)
    blocks = torch.randn(NUM_BLOCKS, LAYERS, 2, BLOCK, KV_HEADS, 64).to(cache_dtype)
    before = blocks.clone()
    split_blocks = blocks.clone()
    fused_out = _run(attn, rotary, norms, qkv, positions, meta, blocks, fused=True)
    split_out = _run(attn, rotary, norms, qkv, positions, meta, split_blocks, fused=False)
    assert fused_out.dtype == dtype and torch.equal(fused_out, split_out)
    assert torch.equal(blocks.view(torch.uint8), split_blocks.view(torch.uint8))
    assert not torch.equal(blocks.view(torch.uint8), before.view(torch.uint8))


def test_layers_the_call_does_not_cover_take_the_separate_steps(kernels):
    backend = select_attention_backend("cpu", "cpu")
    meta, positions = _step(backend, [1, 5], [20, 5])
    qkv = torch.randn(len(positions), (HEADS + 2 * KV_HEADS) * 64)
    blocks = torch.randn(NUM_BLOCKS, LAYERS, 2, BLOCK, KV_HEADS, 64)
    cache = blocks[:, 1].transpose(0, 1)
    partial = RotaryEmbedding(64, 32, 4096, 1.0 / (10000.0 ** (torch.arange(0, 32, 2) / 32)))
    interleaved = get_rope(64, 4096, 10000.0, None, interleaved=True)
    attn, _, (q_norm, k_norm) = _layer(kernels, 64, torch.float32, True)
    k_norm.eps = 1e-3  # the fused norm takes one eps for q and k
    cases = [(partial, None, None), (interleaved, None, None), (get_rope(64, 4096, 10000.0, None), q_norm,
                                                                 k_norm)]
    for rotary, qn, kn in cases:
        bind_platform(rotary, Platform("cpu", kernels))
        attn.rope_kernels.clear()
        meta.derived.clear()
        out = attn.forward_qkv(positions, qkv, rotary, cache, meta, qn, kn)
        assert attn.rope_kernels[torch.float32] is None
        assert out.shape == (len(positions), HEADS * 64)
    # A cache of another dtype than the activations: separate steps (which refuse it).
    attn.rope_kernels.clear()
    assert backend.rope_attention(attn, positions, qkv, get_rope(64, 4096, 10000.0, None), None, None,
                                  cache.to(torch.bfloat16), meta) is None


def test_bad_inputs_are_refused(kernels):
    backend = select_attention_backend("cpu", "cpu")
    meta, positions = _step(backend, [1], [20])
    attn, rotary, norms = _layer(kernels, 64, torch.float32, False)
    blocks = torch.zeros(NUM_BLOCKS, LAYERS, 2, BLOCK, KV_HEADS, 64)
    cache = blocks[:, 1].transpose(0, 1)
    with pytest.raises(RuntimeError, match="qkv must be"):
        attn.forward_qkv(positions, torch.randn(1, 64), rotary, cache, meta)
    meta.derived.clear()
    with pytest.raises(RuntimeError, match="a position past the cache"):
        attn.forward_qkv(torch.tensor([5000]), torch.randn(1, (HEADS + 2 * KV_HEADS) * 64), rotary, cache,
                         meta)
    assert not blocks.any()  # nothing written before the refusal
