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


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """The step's K/V into their slots: one C++ call where the extension reads these tensors
    as they are (K/V rows of adjacent heads in the cache's dtype), else torch's index_copy_."""
    module = load_cpu_attention()
    if (module is not None and k.dtype == v.dtype == cache.dtype
            and k.stride()[1:] == (k.shape[2], 1) and v.stride()[1:] == (v.shape[2], 1)
            and cache.stride()[2:] == (cache.shape[3] * cache.shape[4], cache.shape[4], 1)):
        module.write_kv(cache, k, v, slot_mapping)
    else:
        torch_kernels.write_kv(cache, k, v, slot_mapping)


class CPUAttentionBackend(AttentionBackend):
    name = "cpu"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        write_kv(cache, k, v, meta.slot_mapping)
        return self.attend(q, cache, meta, scale, window, softcap, sinks)

    def attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, window: int = 0, softcap: float = 0.0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        q = q.to(cache.dtype).contiguous()
        out = torch.empty_like(q)
        paged_attention(out, q, cache[0], cache[1], meta.block_tables, meta.query_start_loc,
                        meta.seq_lens, scale, meta.max_query_len, window=window, softcap=softcap,
                        sinks=sinks)
        return out

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
                                cache: torch.Tensor, meta: AttentionMetadata,
                                scale: float) -> torch.Tensor:
        # The kernel's invariant mode: no split-KV, no shared-prefix items, one score path.
        write_kv(cache, k, v, meta.slot_mapping)
        q = q.to(cache.dtype).contiguous()
        out = torch.empty_like(q)
        paged_attention(out, q, cache[0], cache[1], meta.block_tables, meta.query_start_loc,
                        meta.seq_lens, scale, meta.max_query_len, invariant=True)
        return out


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
            or cache.dtype != dtype or layer.head_dim % 16):
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
                                layer.logit_softcap, layer.sinks)
