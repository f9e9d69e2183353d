"""Multi-head latent attention (DeepSeek-V2/V3).

Keys and values of all heads are linear maps of one small latent vector per token, so the
cache keeps only that latent (``kv_lora_rank`` values, normalised) and the shared rotated
key part (``qk_rope_head_dim``): one ``MLALatentSpec`` entry per token per layer.

    q = W_q x (optionally through a low-rank q_a -> norm -> q_b)    [H, nope | rope]
    c, k_pe = W_kv_a x;  c = norm(c);  k_pe = rope(k_pe)             cached: [c | k_pe]
    k_h = [W_UK_h c | k_pe],  v_h = W_UV_h c                         (kv_b_proj = [W_UK; W_UV])

Two equivalent ways to attend, each used where it is cheaper:

* expanded (prefills): k_h, v_h are computed for the sequence's context and attention runs
  with ``nope + rope``-wide heads; cost grows with the context times the heads.
* absorbed (decodes): q_h . k_h = (W_UK_h^T q_nope_h) . c + q_pe_h . k_pe, so the query is
  moved into latent space once and every head attends to the cached entries directly, like
  multi-query attention with ``kv_lora_rank + rope`` wide keys; the values are the entries'
  latent part, and W_UV_h maps each head's result back. Nothing per head is read from the
  cache, which is what makes MLA decode cheap.

Tensor parallel: a rank holds its share of the heads (their rows of q_proj / q_b_proj and
kv_b_proj, their columns of o_proj, reduced by one all-reduce). The latent projection
kv_a_proj_with_mqa is shared by all heads, so every rank computes it and caches the whole
latent entry: MLA's cache is not split (it is already one head wide).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from openinfer.attention.base import AttentionMetadata
from openinfer.distributed.parallel_state import get_tp
from openinfer.kernels.kv_quant import dequantize_kv, quantize_kv
from openinfer.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from openinfer.layers.norm import RMSNorm
from openinfer.layers.rotary import RotaryEmbedding


def yarn_softmax_scale(rope_scaling: dict | None, head_dim: int) -> float:
    """head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 when the RoPE scaling asks."""
    scale = head_dim**-0.5
    scaling = rope_scaling or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    mscale_all_dim = scaling.get("mscale_all_dim") or 0
    factor = scaling.get("factor", 1.0)
    if rope_type != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


@dataclass(frozen=True)
class MLAConfig:
    """The shape of a latent attention (openinfer.models.arch reads it from config.json)."""

    hidden_size: int
    num_heads: int
    """Heads of all tensor-parallel ranks (``num_attention_heads``)."""
    nope_dim: int
    """Each head's query/key dims without position (``qk_nope_head_dim``) ..."""
    rope_dim: int
    """... and with RoPE (``qk_rope_head_dim``, one key part shared by all heads)."""
    v_dim: int
    """Each head's value dims (``v_head_dim``)."""
    latent_dim: int
    """The cached latent (``kv_lora_rank``)."""
    q_lora_rank: int
    """The queries' low-rank projection (``q_lora_rank``); 0: q projected directly."""
    bias: bool
    """Biases on the input and output projections (``attention_bias``)."""
    scale: float
    """The softmax scale (``yarn_softmax_scale``)."""


class MLAAttention(nn.Module):
    def __init__(self, mla: MLAConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, total_heads = mla.hidden_size, mla.num_heads
        self.num_heads = get_tp().split(total_heads, "num_attention_heads")
        """This rank's heads."""
        self.nope_dim, self.rope_dim, self.v_dim = mla.nope_dim, mla.rope_dim, mla.v_dim
        self.latent_dim = mla.latent_dim
        self.q_lora_rank = mla.q_lora_rank
        bias = mla.bias
        qk_dim = self.nope_dim + self.rope_dim
        if self.q_lora_rank:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)  # the references' default eps
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_heads * qk_dim)
        else:
            self.q_proj = ColumnParallelLinear(hidden, total_heads * qk_dim)
        self.kv_a_proj_with_mqa = Linear(hidden, self.latent_dim + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.latent_dim, 1e-6)
        self.kv_b_proj = ColumnParallelLinear(self.latent_dim,
                                              total_heads * (self.nope_dim + self.v_dim))
        self.o_proj = RowParallelLinear(total_heads * self.v_dim, hidden, bias=bias)
        self.rotary = rotary
        self.scale = mla.scale
        self.kv_scale = 1.0
        """The per-tensor scale of the cached entries in a float8 cache (both K and V: one
        tensor; openinfer/kernels/kv_quant.py)."""
        self.w_uk: torch.Tensor | None = None
        """W_UK as [H, nope, latent]: the absorbed decode's query map (process_weights_after_loading)."""
        self.w_uv_t: torch.Tensor | None = None
        """W_UV^T as [H, latent, v]: the absorbed decode's output map."""

    def process_weights_after_loading(self) -> None:
        """Splits kv_b_proj into the absorbed decode's two maps, once, after the weights load
        and before a GEMM plan may pack kv_b_proj and free its plain weight."""
        w = self.kv_b_proj.dense_weight().view(self.num_heads, self.nope_dim + self.v_dim, self.latent_dim)
        # On a CPU they are kept in float32: ATen's bf16 bmm converts element by element on CPUs
        # without bf16 instructions, and the two maps are small beside a layer's weights
        # (DeepSeek-V2-Lite: ~2% of the bytes its decode reads per layer in bf16).
        dtype = torch.float32 if w.device.type == "cpu" else w.dtype
        self.w_uk = w[:, :self.nope_dim].to(dtype).contiguous()
        self.w_uv_t = w[:, self.nope_dim:].transpose(1, 2).to(dtype).contiguous()

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden]; cache: this layer's ``[num_blocks, block_size, latent + rope]``."""
        T, H = x.shape[0], self.num_heads
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q_nope, q_pe = q.view(T, H, self.nope_dim + self.rope_dim).split([self.nope_dim, self.rope_dim], -1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.latent_dim, self.rope_dim], -1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe.unsqueeze(1))
        k_pe = k_pe.squeeze(1)
        block_size = cache.shape[1]
        slots = meta.slot_mapping
        entries = torch.cat([latent, k_pe], -1)
        cache[slots // block_size, slots % block_size] = quantize_kv(entries, self.kv_scale, cache.dtype)

        out = x.new_empty(T, H, self.v_dim)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._absorbed(q_nope[:nd], q_pe[:nd], cache, meta.decodes())
        if nd < meta.num_seqs:
            out[nd:] = self._expanded(q_nope, q_pe, cache, meta)
        return self.o_proj(out.flatten(1))

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        """Decodes: every head attends to the latent entries as one shared K/V head."""
        w_uk, w_uv_t = self.w_uk, self.w_uv_t
        q_latent = torch.bmm(q_nope.transpose(0, 1).to(w_uk.dtype), w_uk).transpose(0, 1)  # [n, H, latent]
        query = torch.cat([q_latent, q_pe.to(q_latent.dtype)], -1)
        # The entries are both the keys and the values: one [2, blocks, bs, 1, latent + rope] view.
        kv = cache.unsqueeze(2).unsqueeze(0).expand(2, *cache.shape[:2], 1, cache.shape[2])
        o_latent = meta.backend.attend(query, kv, meta, self.scale, self.kv_scale,
                                       self.kv_scale)[..., :self.latent_dim]
        return torch.bmm(o_latent.transpose(0, 1).to(w_uv_t.dtype), w_uv_t).transpose(0, 1)

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        """Prefills, all in one backend call: per-head keys and values of every prefill's
        context (its cached latents, this step's included) from one GEMM over the blocks they
        read. K and V share one head width (a multiple of 16, zero-padded: a padded dim adds
        nothing to a score, and V's padding is sliced off the result)."""
        nd, H = meta.num_decodes, self.num_heads
        nope, qk, v_dim = self.nope_dim, self.nope_dim + self.rope_dim, self.v_dim
        block_ids, prefills = meta.gathered_prefills()
        ctx = cache.index_select(0, block_ids)  # [n, block_size, latent + rope]
        ctx = dequantize_kv(ctx, self.kv_scale, q_nope.dtype)
        n, block_size = ctx.shape[:2]
        kv = self.kv_b_proj(ctx[..., :self.latent_dim].flatten(0, 1))
        kv = kv.view(n, block_size, H, nope + v_dim)
        width = -(-max(qk, v_dim) // 16) * 16
        keys_values = kv.new_empty(2, n, block_size, H, width)
        keys_values[0, ..., :nope] = kv[..., :nope]
        keys_values[0, ..., nope:qk] = ctx[:, :, None, self.latent_dim:]
        keys_values[0, ..., qk:] = 0
        keys_values[1, ..., :v_dim] = kv[..., nope:]
        keys_values[1, ..., v_dim:] = 0
        query = q_nope.new_zeros(q_nope.shape[0] - nd, H, width)
        query[..., :nope] = q_nope[nd:]
        query[..., nope:qk] = q_pe[nd:]
        return meta.backend.attend(query, keys_values, prefills, self.scale)[..., :v_dim]
