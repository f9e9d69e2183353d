"""The CPU backend: one C++ kernel per layer for every sequence of the step (prefill,
chunked continuation, prefix hit, decode), reading KV blocks in place through the block
table (openinfer/kernels/cpu_attention.py). Nothing is gathered or padded."""

from __future__ import annotations

import torch

from openinfer.attention.base import (
    AttentionBackend,
    AttentionLayerShape,
    AttentionMetadata,
    NormWeights,
    RotaryTables,
)
from openinfer.kernels import paged_attention as torch_kernels
from openinfer.kernels.cpu_attention import bf16_dot, load_cpu_attention, paged_attention
from openinfer.kernels.kv_quant import is_fp8


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """The step's K/V into their slots: one C++ call where the extension reads these tensors
    as they are (K/V rows of adjacent heads in the cache's dtype, or fp32/bf16 rows into a
    float8 cache), else torch's index_copy_."""
    module = load_cpu_attention()
    if (module is not None and k.dtype == v.dtype
            and (k.dtype == cache.dtype or (is_fp8(cache.dtype) and k.dtype in _FP8_SOURCES))
            and k.stride()[1:] == (k.shape[2], 1) and v.stride()[1:] == (v.shape[2], 1)
            and cache.stride()[2:] == (cache.shape[3] * cache.shape[4], cache.shape[4], 1)):
        module.write_kv(cache, k, v, slot_mapping, k_scale, v_scale)
    else:
        torch_kernels.write_kv(cache, k, v, slot_mapping, k_scale, v_scale)


_FP8_SOURCES = (torch.float32, torch.bfloat16)
"""What the C++ write quantizes into a float8 cache."""


class CPUAttentionBackend(AttentionBackend):
    name = "cpu"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        write_kv(cache, k, v, meta.slot_mapping, k_scale, v_scale)
        return self._attend(q, cache, meta, scale, window, softcap, sinks, k_scale, v_scale)

    def attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        return self._attend(q, cache, meta, scale, k_scale=k_scale, v_scale=v_scale)

    @staticmethod
    def _attend(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                k_scale: float = 1.0, v_scale: float = 1.0, invariant: bool = False) -> torch.Tensor:
        """The kernel over the cache: q in the cache's dtype, or as it is (fp32/bf16) over a
        float8 cache; the result in q's dtype."""
        out_dtype = q.dtype
        q = q.to(query_dtype(q.dtype, cache.dtype)).contiguous()
        out = torch.empty_like(q)
        paged_attention(out, q, cache[0], cache[1], meta.block_tables, meta.query_start_loc,
                        meta.seq_lens, scale, meta.max_query_len, invariant=invariant, window=window,
                        softcap=softcap, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
        return out.to(out_dtype)

    def rope_attention(self, layer: AttentionLayerShape, positions: torch.Tensor, qkv: torch.Tensor,
                       rotary: RotaryTables, q_norm: NormWeights | None, k_norm: NormWeights | None,
                       cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """One C++ call (``RopeAttention``) where the layer's kernel applies: made at its first
        call for this dtype and kept on the layer, None for the layers it does not cover."""
        kernel = layer.rope_kernels.get(qkv.dtype, _UNDECIDED)
        if kernel is _UNDECIDED:
            kernel = layer.rope_kernels[qkv.dtype] = rope_kernel(layer, qkv.dtype, rotary, q_norm, k_norm,
                                                                 cache)
        if kernel is None:
            return None
        return kernel(qkv, cache, attention_step(meta, positions))

    def forward_batch_invariant(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                                k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        # The kernel's invariant mode: no split-KV, no shared-prefix items, one score path.
        write_kv(cache, k, v, meta.slot_mapping, k_scale, v_scale)
        return self._attend(q, cache, meta, scale, k_scale=k_scale, v_scale=v_scale, invariant=True)


_UNDECIDED = object()


def attention_step(meta: AttentionMetadata, positions: torch.Tensor):
    """The step's ``AttentionStep`` (its metadata for the C++ calls), made by its first layer."""
    step = meta.derived.get("cpu_step")
    if step is None:
        step = meta.derived["cpu_step"] = load_cpu_attention().AttentionStep(
            positions, meta.slot_mapping, meta.block_tables, meta.query_start_loc, meta.seq_lens,
            meta.max_query_len, bf16_dot())
    return step


def rope_kernel(layer: AttentionLayerShape, dtype: torch.dtype, rotary: RotaryTables,
                q_norm: NormWeights | None, k_norm: NormWeights | None, cache: torch.Tensor):
    """The layer's ``RopeAttention`` for activations of ``dtype``, or None where its separate
    calls would not all run in the extension (a rotation or norm the kernels do not compute, a
    cache of another dtype)."""
    module = load_cpu_attention()
    if (module is None or rotary.cpu_kernels is None or rotary.interleaved
            or rotary.rotary_dim != rotary.head_dim or dtype not in (torch.float32, torch.bfloat16)
            or not (cache.dtype == dtype or is_fp8(cache.dtype)) or layer.head_dim % 16):
        return None
    norms: tuple = (None, None, 0.0)
    if q_norm is not None:
        if not (k_norm is not None and q_norm.eps == k_norm.eps and q_norm.weight.dtype == dtype
                and k_norm.weight.dtype == dtype and q_norm.cpu_kernels is not None
                and q_norm.weight.numel() == layer.head_dim == k_norm.weight.numel() <= 512):
            return None
        norms = (q_norm.weight, k_norm.weight, q_norm.eps)
    return module.RopeAttention(layer.num_heads, layer.num_kv_heads, layer.head_dim, rotary.cos_cache,
                                rotary.sin_cache, *norms, layer.scale, layer.sliding_window,
                                layer.logit_softcap, layer.sinks, layer.k_scale, layer.v_scale)


def query_dtype(dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernel takes queries in: the cache's, or for a float8 cache the query's
    own where the kernel computes with it (fp32, bf16; else fp32)."""
    if not is_fp8(cache_dtype):
        return cache_dtype
    return dtype if dtype in _FP8_SOURCES else torch.float32
