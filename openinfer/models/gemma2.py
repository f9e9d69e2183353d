"""Gemma 2: sliding-window and full attention layers alternating (``layer_types``), with
soft-capped attention scores and logits, and a norm before *and after* each sublayer.

    x ─ embed·√H ─┬─ norm ─ Attention ─ norm ─(+)─┬─ norm ─ MLP(gelu) ─ norm ─(+)─ ... ─ norm ─ LM head
                  └───────────────────────────────┘└──────────────────────────────┘      cap·tanh(·/cap)

Attention scores are ``cap·tanh(s/cap)`` (``attn_logit_softcapping``) with the scale
``query_pre_attn_scalar^-1/2``; the logits get the same with ``final_logit_softcapping``.
Gemma's RMSNorm multiplies by ``1 + weight``: the checkpoint's weights load plus one, so the
norms are plain RMSNorms (and the fused CPU kernels apply).
"""

from __future__ import annotations

import torch
from torch import nn

from openinfer.attention.base import AttentionMetadata
from openinfer.layers.attention import Attention
from openinfer.layers.embedding import LMHead, VocabEmbedding
from openinfer.layers.mlp import GatedMLP
from openinfer.layers.norm import RMSNorm
from openinfer.models.arch import ArchConfig
from openinfer.models.llama import BlockVariant, DecoderStack, LlamaAttention, LlamaForCausalLM, shared_rope


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaling by ``1 + weight``: loaded as ``weight + 1``."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = lambda param, loaded: param.copy_(loaded.float() + 1.0)


class ScaledEmbedding(VocabEmbedding):
    """Token embeddings times ``sqrt(hidden_size)``, the factor rounded to the weights' dtype
    as the reference does."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.scale = hidden_size**0.5

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = super().forward(token_ids)
        return x * torch.tensor(self.scale, dtype=x.dtype)


class Gemma2DecoderLayer(nn.Module):
    """x + norm(attn(norm(x))), then + norm(mlp(norm(x))); the residual add is fused into the
    next norm, as in ``DecoderLayer`` (the layer returns its MLP branch and the running sum)."""

    def __init__(self, arch: ArchConfig, attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = attn
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, cache, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2Model(DecoderStack):
    def __init__(self, arch: ArchConfig, variant: BlockVariant) -> None:
        super().__init__()
        hidden, head_dim = arch.hidden_size, arch.head_dim
        self.embed_tokens = ScaledEmbedding(arch.vocab_size, hidden)
        rotary = shared_rope(arch)
        # Gemma's own keys: the scores' scale and soft cap.
        scale = arch.raw.get("query_pre_attn_scalar", head_dim) ** -0.5
        softcap = arch.raw.get("attn_logit_softcapping")
        layers = []
        for i in range(arch.num_layers):
            attn = LlamaAttention(arch, variant, rotary)
            attn.attn = Attention(attn.num_heads, attn.num_kv_heads, head_dim, scale,
                                  sliding_window=arch.sliding_windows[i], logit_softcap=softcap)
            mlp = GatedMLP(hidden, arch.intermediate_size, activation=arch.hidden_act)
            layers.append(Gemma2DecoderLayer(arch, attn, mlp))
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(hidden, arch.rms_norm_eps)


class Gemma2ForCausalLM(LlamaForCausalLM):
    supports_tensor_parallel = False  # (its scaled embedding and softcaps are not sharded yet)
    supports_context_parallel = False  # (its sliding-window layers)

    def __init__(self, arch: ArchConfig) -> None:
        nn.Module.__init__(self)
        self.model = Gemma2Model(arch, self.block_variant(arch))
        tied = arch.raw.get("tie_word_embeddings", True)  # tied unless the config says (reference)
        self.lm_head = LMHead(arch.vocab_size, arch.hidden_size, self.model.embed_tokens if tied else None)
        self.final_logit_softcap = arch.raw.get("final_logit_softcapping") or 0.0

    @classmethod
    def block_variant(cls, arch: ArchConfig) -> BlockVariant:
        bias = arch.attention_bias
        return BlockVariant(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_logit_softcap:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
