"""A model's attention layer: its head geometry and scale; the work is the backend's.

The step's backend and metadata come in ``meta`` (openinfer/attention/), built once per
step by the model runner, so the layer holds no global state and no per-step tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from openinfer.attention.base import AttentionMetadata
from openinfer.kernels.custom_op import CustomOp, Platform

if TYPE_CHECKING:
    from openinfer.layers.norm import RMSNorm
    from openinfer.layers.rotary import RotaryEmbedding


class Attention(CustomOp):
    """Stores this step's K/V in the paged cache, then attends over each sequence's context.
    ``forward_batch_invariant`` (``--batch-invariant``): the backend's batch-invariant mode,
    whose rows never depend on the rest of the step."""

    batch_dependent = True
    fuses_rope = True
    """Whether ``forward_qkv`` may hand the backend the whole rotate-and-attend chain (not in
    batch-invariant mode, whose backend path takes rotated q and k)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None,
                 sinks: bool = False) -> None:
        """``sliding_window``: query p sees keys p - window + 1 .. p (transformers' meaning);
        ``logit_softcap``: scores pass through softcap * tanh(s / softcap) (Gemma 2);
        ``sinks``: a learned logit per head in the softmax denominator (gpt-oss)."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window or 0
        self.logit_softcap = logit_softcap or 0.0
        self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False) if sinks else None
        self.rope_kernels: dict[torch.dtype, object] = {}
        """A backend's fused kernel for ``forward_qkv`` per compute dtype (``None``: none)."""
        self.k_scale = 1.0
        self.v_scale = 1.0
        """Per-tensor scales of K and V in a float8 cache (openinfer/kernels/kv_quant.py): the
        checkpoint's ``k_scale``/``v_scale`` where it has them."""

    @property
    def is_variant(self) -> bool:
        """Whether this layer needs more than plain causal attention."""
        return bool(self.sliding_window or self.logit_softcap or self.sinks is not None)

    def bind(self, platform: Platform) -> None:
        super().bind(platform)
        self.fuses_rope = not platform.batch_invariant

    def forward_native(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, H, D]; cache: this layer's [2, num_blocks, bs, H, D]."""
        if meta.context_parallel is not None:  # the other ranks' pieces of split prompts
            meta.context_parallel.exchange_kv(cache, k, v, self.k_scale, self.v_scale)
        return meta.backend.forward(q, k, v, cache, meta, self.scale, self.sliding_window,
                                    self.logit_softcap, self.sinks, self.k_scale, self.v_scale)

    def forward_batch_invariant(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.context_parallel is not None:
            meta.context_parallel.exchange_kv(cache, k, v, self.k_scale, self.v_scale)
        return meta.backend.forward_batch_invariant(q, k, v, cache, meta, self.scale, self.k_scale,
                                                    self.v_scale)

    def forward_qkv(self, positions: torch.Tensor, qkv: torch.Tensor, rotary: RotaryEmbedding,
                    cache: torch.Tensor, meta: AttentionMetadata, q_norm: RMSNorm | None = None,
                    k_norm: RMSNorm | None = None) -> torch.Tensor:
        """Attention from the merged q/k/v projection ``qkv`` [T, (Hq + 2 Hkv) * D]: q, k and v
        split into heads, q and k normalised per head (``q_norm``/``k_norm``, Qwen3) and
        rotated, then ``forward``; returns [T, Hq * D]. A backend may run the whole chain in
        one call (``AttentionBackend.rope_attention``; the cpu backend's C++ entry)."""
        if self.fuses_rope and meta.context_parallel is None:
            out = meta.backend.rope_attention(self, positions, qkv, rotary, q_norm, k_norm, cache, meta)
            if out is not None:
                return out
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if q_norm is not None:  # normalised and rotated in one pass where the CPU kernel can
            q, k = rotary(positions, q, k, q_norm, k_norm)
        else:
            q, k = rotary(positions, q, k)
        return self(q, k, v, cache, meta).flatten(1)
