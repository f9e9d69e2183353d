"""Llama: a pre-norm decoder of (GQA attention with RoPE) + (gated SiLU MLP) blocks.

Qwen2 (bias on q/k/v) and Qwen3 (RMSNorm on each head's q and k) are variants of the
same block, expressed as two flags rather than copies of this file. Mistral is Llama with a
sliding window on every layer; Qwen2/3 may put one on some layers (``layer_types``).

    x ─ embed ─┬─ RMSNorm ─ Attention ─(+)─┬─ RMSNorm ─ MLP ─(+)─ ... ─ RMSNorm ─ LM head
               └────────────────────────────┘└──────────────────┘

Tensor parallel (Megatron), applied by the layers: ``qkv_proj`` holds a rank's share of the
query and KV heads (openinfer.layers.linear.QKVParallelLinear), ``gate_up_proj`` its share of
the MLP's intermediate features; ``o_proj`` and ``down_proj`` all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from openinfer.attention.base import AttentionMetadata
from openinfer.kernels.custom_op import CustomOp
from openinfer.kv.spec import FullAttentionSpec, KVSpec, SlidingWindowSpec
from openinfer.layers.attention import Attention
from openinfer.layers.embedding import LMHead, VocabEmbedding
from openinfer.layers.linear import QKVParallelLinear, RowParallelLinear
from openinfer.layers.mlp import GatedMLP
from openinfer.layers.norm import RMSNorm
from openinfer.layers.rotary import RotaryEmbedding, get_rope
from openinfer.models import llama_cpu
from openinfer.models.arch import ArchConfig
from openinfer.models.base import CausalLM


@dataclass(frozen=True)
class BlockVariant:
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    attention_sinks: bool = False
    """A learned logit per head in the softmax denominator (gpt-oss)."""


class LlamaAttention(nn.Module):
    def __init__(self, arch: ArchConfig, variant: BlockVariant, rotary: RotaryEmbedding,
                 window: int | None = None) -> None:
        super().__init__()
        self.head_dim = arch.head_dim
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, arch.head_dim, arch.num_heads,
                                          arch.num_kv_heads, bias=variant.qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        """This rank's."""
        self.o_proj = RowParallelLinear(arch.num_heads * arch.head_dim, arch.hidden_size,
                                        bias=variant.o_bias)
        if variant.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.qk_norm = variant.qk_norm
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
                              sliding_window=window, sinks=variant.attention_sinks)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.qk_norm:  # Qwen3: each head's q and k normalised before RoPE
            out = self.attn.forward_qkv(positions, qkv, self.rotary, cache, meta, self.q_norm, self.k_norm)
        else:
            out = self.attn.forward_qkv(positions, qkv, self.rotary, cache, meta)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    """The pre-norm block every model here is made of: x + attn(norm(x)), then + mlp(norm(x)),
    with the residual add fused into the next norm. The attention (GQA, MLA) and the MLP
    (dense, MoE) are the model's."""

    def __init__(self, arch: ArchConfig, attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = mlp

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderStack(CustomOp):
    """embed -> decoder layers -> final norm; subclasses build ``embed_tokens``, ``layers`` and
    ``norm``. ``forward_cpu``: Llama blocks run in one C++ call per step
    (openinfer/models/llama_cpu.py) where it covers the model and the step."""

    embed_tokens: VocabEmbedding
    layers: nn.ModuleList
    norm: RMSNorm

    def __init__(self) -> None:
        super().__init__()
        self.cpu_layers: dict[torch.dtype, object] = {}
        """The C++ call per activation dtype (None: not covered), made at the first step."""
        self.feature_layers: tuple[int, ...] = ()
        """Layers whose input hidden states a drafter reads (DSpark, openinfer/models/dspark.py)."""
        self.features: torch.Tensor | None = None
        """After a step with ``feature_layers``: those inputs side by side, [T, n * hidden]."""

    def forward_native(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       kv_caches: list[torch.Tensor], metas: list[AttentionMetadata]) -> torch.Tensor:
        return self._run_layers(self.embed_tokens(input_ids), positions, kv_caches, metas)

    def forward_cpu(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    kv_caches: list[torch.Tensor], metas: list[AttentionMetadata]) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        done = llama_cpu.run_layers(self, self.cpu_kernels, positions, x, kv_caches, metas,
                                    tuple(sorted(self.feature_layers)))
        if done is None:
            return self._run_layers(x, positions, kv_caches, metas)
        x, residual, kept = done
        if kept:
            by_layer = dict(zip(sorted(self.feature_layers), kept))
            self.features = torch.cat([by_layer[i] for i in self.feature_layers], dim=-1)
        x, _ = self.norm(x, residual)
        return x

    def _run_layers(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                    metas: list[AttentionMetadata]) -> torch.Tensor:
        residual = None
        entering: dict[int, torch.Tensor] = {}
        for i, (layer, cache, meta) in enumerate(zip(self.layers, kv_caches, metas)):
            if i in self.feature_layers:
                entering[i] = x if residual is None else x + residual
            x, residual = layer(positions, x, residual, cache, meta)
        if entering:
            self.features = torch.cat([entering[i] for i in self.feature_layers], dim=-1)
        x, _ = self.norm(x, residual)
        return x

    def llama_blocks(self) -> list[llama_cpu.LlamaBlock] | None:
        """Each layer's (input norm, attention, post-attention norm, MLP) where every layer is a
        plain Llama block, the one the C++ call computes; else None."""
        blocks = []
        for layer in self.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if not (type(layer) is DecoderLayer and type(attn) is LlamaAttention
                    and type(mlp) is GatedMLP):
                return None
            blocks.append((layer.input_layernorm, attn, layer.post_attention_layernorm, mlp))
        return blocks


class LlamaModel(DecoderStack):
    def __init__(self, arch: ArchConfig, variant: BlockVariant,
                 make_mlp: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(arch.vocab_size, arch.hidden_size)
        rotary = shared_rope(arch)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, LlamaAttention(arch, variant, rotary, arch.sliding_windows[i]),
                         make_mlp(i))
            for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    variant = BlockVariant(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)
    supports_tensor_parallel = True
    supports_context_parallel = True
    """Plain per-head attention: a prompt's pieces attend through the usual paged cache
    (openinfer/distributed/context_parallel.py)."""

    # Checkpoint names that load into a slice of one of our merged parameters.
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.model = LlamaModel(arch, self.block_variant(arch), lambda layer: self.make_mlp(arch, layer))
        tied = self.model.embed_tokens if arch.tie_word_embeddings else None
        self.lm_head = LMHead(arch.vocab_size, arch.hidden_size, tied)

    @classmethod
    def block_variant(cls, arch: ArchConfig) -> BlockVariant:
        bias = arch.attention_bias
        return BlockVariant(qkv_bias=bias, o_bias=bias, mlp_bias=arch.mlp_bias, qk_norm=False)

    @classmethod
    def make_mlp(cls, arch: ArchConfig, layer: int) -> nn.Module:
        """Layer ``layer``'s feed-forward block (mixture-of-experts models override this)."""
        require_silu(arch)
        return GatedMLP(arch.hidden_size, arch.intermediate_size, bias=cls.block_variant(arch).mlp_bias)

    def kv_cache_specs(self, block_size: int, dtype: str) -> list[KVSpec | None]:
        """What each layer keeps per token: K and V of its KV heads, in every layer (of its
        window's last tokens only, in sliding-window layers)."""
        return [attention_spec(layer.self_attn.attn, block_size, dtype) for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metas: list[AttentionMetadata]) -> torch.Tensor:
        """Hidden states of the step's tokens, [T, hidden]; ``kv_caches`` and ``metas`` are
        per layer (a layer's cache view and its layer group's step metadata)."""
        return self.model(input_ids, positions, kv_caches, metas)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def attention_spec(attn: Attention, block_size: int, dtype: str) -> KVSpec:
    """The KV spec of a (GQA) attention layer: full, or its sliding window."""
    if attn.sliding_window:
        return SlidingWindowSpec(block_size, attn.num_kv_heads, attn.head_dim, dtype,
                                 attn.sliding_window)
    return FullAttentionSpec(block_size, attn.num_kv_heads, attn.head_dim, dtype)


def require_silu(arch: ArchConfig) -> None:
    if arch.hidden_act != "silu":
        raise ValueError(f"hidden_act {arch.hidden_act!r} is not supported (gated MLPs run silu)")


def shared_rope(arch: ArchConfig, head_dim: int | None = None, interleaved: bool = False) -> RotaryEmbedding:
    """The one cos/sin table all layers share, for heads of ``head_dim`` (the model's): it
    spans the trained context (``max_position_embeddings``), whatever max_model_len is."""
    rope = arch.rope
    return get_rope(head_dim or arch.head_dim, rope.max_position, rope.theta, rope.scaling,
                    rope.partial_rotary_factor, interleaved)
