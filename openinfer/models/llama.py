"""Llama: a pre-norm decoder of (GQA attention with RoPE) + (gated SiLU MLP) blocks.

Qwen2 (bias on q/k/v) and Qwen3 (RMSNorm on each head's q and k) are variants of the
same block, expressed as two flags rather than copies of this file. Mistral is Llama with a
sliding window on every layer; Qwen2/3 may put one on some layers (``layer_types``).

    x ─ embed ─┬─ RMSNorm ─ Attention ─(+)─┬─ RMSNorm ─ MLP ─(+)─ ... ─ RMSNorm ─ LM head
               └────────────────────────────┘└──────────────────┘

Tensor parallel (Megatron): a rank holds its share of the query heads and of the KV heads
(each KV head on tp / num_kv_heads ranks when there are fewer KV heads than ranks), and of
the MLP's intermediate features; ``o_proj`` and ``down_proj`` all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from openinfer.attention.base import AttentionMetadata
from openinfer.distributed.parallel_state import get_tp
from openinfer.kernels.custom_op import CustomOp
from openinfer.kv.spec import FullAttentionSpec, KVSpec, SlidingWindowSpec
from openinfer.layers.attention import Attention
from openinfer.layers.embedding import LMHead, VocabEmbedding
from openinfer.layers.linear import MergedLinear, RowParallelLinear
from openinfer.layers.mlp import GatedMLP
from openinfer.layers.norm import RMSNorm
from openinfer.layers.rotary import RotaryEmbedding, get_rope
from openinfer.models import llama_cpu
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
    def __init__(self, hf: dict, variant: BlockVariant, rotary: RotaryEmbedding,
                 window: int | None = None) -> None:
        super().__init__()
        hidden = hf["hidden_size"]
        total_heads = hf["num_attention_heads"]
        total_kv_heads = hf.get("num_key_value_heads") or total_heads
        self.head_dim = hf.get("head_dim") or hidden // total_heads
        tp = get_tp()
        self.num_heads = tp.split(total_heads, "num_attention_heads")
        if total_kv_heads >= tp.size:
            self.num_kv_heads = tp.split(total_kv_heads, "num_key_value_heads")
            first_kv_head = tp.rank * self.num_kv_heads
        else:  # each KV head is replicated on tp / num_kv_heads ranks
            if tp.size % total_kv_heads:
                raise ValueError(f"num_key_value_heads ({total_kv_heads}) does not divide "
                                 f"tensor_parallel_size {tp.size}")
            self.num_kv_heads = 1
            first_kv_head = tp.rank * total_kv_heads // tp.size
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            hidden, [q_size, kv_size, kv_size], bias=variant.qkv_bias,
            shard_offsets=None if tp.size == 1 else [
                tp.rank * q_size, *[first_kv_head * self.head_dim] * 2])
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=variant.o_bias)
        if variant.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, hf.get("rms_norm_eps", 1e-6))
            self.k_norm = RMSNorm(self.head_dim, hf.get("rms_norm_eps", 1e-6))
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

    def __init__(self, hf: dict, attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        eps = hf.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hf["hidden_size"], eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(hf["hidden_size"], eps)
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

    def forward_native(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       kv_caches: list[torch.Tensor], metas: list[AttentionMetadata]) -> torch.Tensor:
        return self._run_layers(self.embed_tokens(input_ids), positions, kv_caches, metas)

    def forward_cpu(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    kv_caches: list[torch.Tensor], metas: list[AttentionMetadata]) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        done = llama_cpu.run_layers(self, self.cpu_kernels, positions, x, kv_caches, metas)
        if done is None:
            return self._run_layers(x, positions, kv_caches, metas)
        x, _ = self.norm(*done)
        return x

    def _run_layers(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                    metas: list[AttentionMetadata]) -> torch.Tensor:
        residual = None
        for layer, cache, meta in zip(self.layers, kv_caches, metas):
            x, residual = layer(positions, x, residual, cache, meta)
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
    def __init__(self, hf: dict, variant: BlockVariant, make_mlp: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(hf["vocab_size"], hf["hidden_size"])
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        # One cos/sin table shared by all layers. It spans the model's trained context:
        # llama3/yarn scaling read max_position_embeddings, whatever max_model_len is.
        rotary = get_rope(head_dim, hf["max_position_embeddings"], rope_theta(hf), rope_scaling(hf),
                          hf.get("partial_rotary_factor", 1.0))
        self.layers = nn.ModuleList(
            DecoderLayer(hf, LlamaAttention(hf, variant, rotary, sliding_window(hf, i)), make_mlp(i))
            for i in range(hf["num_hidden_layers"])
        )
        self.norm = RMSNorm(hf["hidden_size"], hf.get("rms_norm_eps", 1e-6))


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

    def __init__(self, hf: dict) -> None:
        super().__init__()
        self.model = LlamaModel(hf, self.block_variant(hf), lambda layer: self.make_mlp(hf, layer))
        tied = self.model.embed_tokens if hf.get("tie_word_embeddings", False) else None
        self.lm_head = LMHead(hf["vocab_size"], hf["hidden_size"], tied)

    @classmethod
    def block_variant(cls, hf: dict) -> BlockVariant:
        bias = bool(hf.get("attention_bias", False))
        return BlockVariant(qkv_bias=bias, o_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)),
                            qk_norm=False)

    @classmethod
    def make_mlp(cls, hf: dict, layer: int) -> nn.Module:
        """Layer ``layer``'s feed-forward block (mixture-of-experts models override this)."""
        require_silu(hf)
        return GatedMLP(hf["hidden_size"], hf["intermediate_size"], bias=cls.block_variant(hf).mlp_bias)

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


def sliding_window(hf: dict, layer: int) -> int | None:
    """Layer ``layer``'s window from config.json: every layer's (Mistral, Mixtral), those that
    ``layer_types`` names ``sliding_attention``, or none (Qwen2/3 unless ``use_sliding_window``)."""
    window = hf.get("sliding_window")
    if not window or hf.get("use_sliding_window") is False:
        return None
    types = hf.get("layer_types")
    if types is not None:
        return window if types[layer] == "sliding_attention" else None
    if "max_window_layers" in hf:  # Qwen configs written before layer_types existed
        return window if layer >= hf["max_window_layers"] else None
    return window


def attention_spec(attn: Attention, block_size: int, dtype: str) -> KVSpec:
    """The KV spec of a (GQA) attention layer: full, or its sliding window."""
    if attn.sliding_window:
        return SlidingWindowSpec(block_size, attn.num_kv_heads, attn.head_dim, dtype,
                                 attn.sliding_window)
    return FullAttentionSpec(block_size, attn.num_kv_heads, attn.head_dim, dtype)


def require_silu(hf: dict) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (gated MLPs run silu)")


def rope_theta(hf: dict) -> float:
    params = hf.get("rope_parameters") or {}
    return float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)


def rope_scaling(hf: dict) -> dict | None:
    """RoPE scaling from config.json: `rope_scaling` (transformers v4) or `rope_parameters` (v5)."""
    return hf.get("rope_scaling") or hf.get("rope_parameters")
