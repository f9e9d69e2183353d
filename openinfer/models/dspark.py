"""DSpark: DeepSeek's block drafter (DeepInfer calls it DFlash), for a dense target.

It drafts a block of B tokens in one parallel pass, reading the target's hidden states:

    features_j = [ h^{t_1}_j | h^{t_2}_j | ... ]       the target's residual stream entering
                                                      each of its layers t_i, at position j
    main_j     = RMSNorm(main_proj(features_j))        one context vector per position

Each draft layer keeps, per context position j, the K and V its own projections give
``main_j`` (k-normed, rotated at j): written while the target computes j, kept in the
engine's paged cache like any layer's. After the target samples token g at position p + 1,
the block [g, noise, ..., noise] (positions p + 1 .. p + B) runs through the draft layers
(Llama blocks whose attention sees the context keys 0 .. p and the whole block, no causal
mask inside it), and row i's final state h_i gives draft i (position p + 2 + i):

    logits_i     = lm_head(norm(h_i)) + markov_head(markov_embed(d_{i-1}))    (d_{-1} = g)
    confidence_i = sigmoid([h_i | markov_embed(d_{i-1})] . w / T)

so a draft's confidence is fixed before it is drawn (DSpark's non-anticipation: the
verifier stays lossless whichever prefix the scheduler verifies). The embeddings and the
LM head are the target's.

Checkpoint (a directory: config.json and safetensors), the target's Llama/Qwen3 names for
the blocks:

    config.json: architectures ["DSparkDrafter"], the block shape (hidden_size = the target's,
      num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
      intermediate_size, rms_norm_eps, rope_theta, max_position_embeddings, vocab_size,
      qk_norm) and DeepInfer's dspark_block_size, dspark_target_layer_ids,
      dspark_markov_rank, dspark_noise_token_id; optionally
      dspark_confidence_temperature (default 1)
    main_proj.weight [H, len(target_layer_ids) * H]    main_norm.weight [H]
    layers.<i>.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm (qk_norm),
      post_attention_layernorm, mlp.{gate,up,down}_proj}.weight    norm.weight [H]
    markov_head.embed.weight [V, r]    markov_head.head.weight [V, r]
    confidence_head.proj.weight [1, H + r]
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.kernels.paged_attention import gather_kv_padded, write_kv
from openinfer.kv.spec import KVSpec
from openinfer.layers.linear import Linear
from openinfer.layers.mlp import GatedMLP
from openinfer.layers.norm import RMSNorm
from openinfer.models.arch import ArchConfig
from openinfer.models.llama import (
    BlockVariant,
    DecoderLayer,
    LlamaAttention,
    LlamaForCausalLM,
    attention_spec,
    require_silu,
    shared_rope,
)

ARCHITECTURE = "DSparkDrafter"


@dataclass(frozen=True)
class DSparkConfig:
    block_size: int
    """Rows of one drafting pass (the last sampled token, then noise): drafts per pass."""
    target_layer_ids: tuple[int, ...]
    """The target layers whose input hidden states make the context."""
    markov_rank: int
    noise_token_id: int
    confidence_temperature: float = 1.0

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DSparkConfig:
        missing = [k for k in ("dspark_block_size", "dspark_target_layer_ids",
                               "dspark_markov_rank", "dspark_noise_token_id") if k not in hf]
        if missing:
            raise ValueError(f"DSpark drafter config lacks {', '.join(missing)}")
        if hf.get("sliding_window"):
            raise ValueError("DSpark drafter config: sliding_window is not supported (the "
                             "draft layers attend to the whole context)")
        return cls(int(hf["dspark_block_size"]), tuple(int(t) for t in hf["dspark_target_layer_ids"]),
                   int(hf["dspark_markov_rank"]), int(hf["dspark_noise_token_id"]),
                   float(hf.get("dspark_confidence_temperature", 1.0)))


class DSparkAttention(LlamaAttention):
    """A Llama attention whose keys come two ways: the context's from ``main`` (written to
    the paged cache), the block's from its own rows (kept for the pass only)."""

    def _heads(self, positions: torch.Tensor, x: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.rotary(positions, q, k, self.q_norm, self.k_norm)
        else:
            q, k = self.rotary(positions, q, k)
        return q, k, v

    def write_context(self, positions: torch.Tensor, main: torch.Tensor, cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        _, k, v = self._heads(positions, main)
        write_kv(cache, k, v, slot_mapping, self.attn.k_scale, self.attn.v_scale)

    def forward_block(self, positions: torch.Tensor, x: torch.Tensor, cache: torch.Tensor,
                      tables: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x: [R * B, hidden], request r's block rows r*B .. r*B + B - 1; ``tables`` [R, blocks]
        its context's block table (padded); ``mask`` [R, 1, 1, blocks * block_size + B]: the keys
        each block sees (its context's, then its own)."""
        q, k, v = self._heads(positions, x)
        rows = len(tables)
        k_ctx, v_ctx = gather_kv_padded(cache, tables, self.attn.k_scale, self.attn.v_scale, k.dtype)
        keys = torch.cat([k_ctx, k.view(rows, -1, *k.shape[1:])], 1).transpose(1, 2)
        values = torch.cat([v_ctx, v.view(rows, -1, *v.shape[1:])], 1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.view(rows, -1, *q.shape[1:]).transpose(1, 2), keys,
                                             values, attn_mask=mask, scale=self.attn.scale,
                                             enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(x.shape[0], -1))


class MarkovHead(nn.Module):
    """A low-rank bigram term: the previous token's embedding [r], then its logits [V]."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)
        self.head = Linear(rank, vocab_size)


class ConfidenceHead(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = Linear(width, 1)


class DSparkDrafterModel(nn.Module):
    """The drafter's own weights; the target lends its embeddings and LM head."""

    # The loader's contract (openinfer/models/base.py), with the target's block names.
    packed_modules: ClassVar[dict[str, tuple[str, int]]] = LlamaForCausalLM.packed_modules
    checkpoint_renames: ClassVar[dict[str, str]] = {}
    expert_weights: ClassVar[dict[str, tuple[str, int]]] = {}
    checkpoint_prefixes: dict[str, str] = {}
    optional_modules: ClassVar[tuple[str, ...]] = ()
    supports_fp8_kv_cache: ClassVar[bool] = True  # its K/V go through write_kv / gather_kv

    def __init__(self, arch: ArchConfig, dspark: DSparkConfig) -> None:
        super().__init__()
        require_silu(arch)
        self.dspark = dspark
        hidden = arch.hidden_size
        variant = BlockVariant(qkv_bias=arch.attention_bias, o_bias=arch.attention_bias,
                               mlp_bias=arch.mlp_bias, qk_norm=bool(arch.raw.get("qk_norm", True)))
        rotary = shared_rope(arch)
        self.max_position = arch.rope.max_position
        """Positions the RoPE table covers (0 .. this - 1)."""
        self.main_proj = Linear(len(dspark.target_layer_ids) * hidden, hidden)
        self.main_norm = RMSNorm(hidden, arch.rms_norm_eps)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, DSparkAttention(arch, variant, rotary),
                         GatedMLP(hidden, arch.intermediate_size, bias=arch.mlp_bias))
            for _ in range(arch.num_layers))
        self.norm = RMSNorm(hidden, arch.rms_norm_eps)
        self.markov_head = MarkovHead(arch.vocab_size, dspark.markov_rank)
        self.confidence_head = ConfidenceHead(hidden + dspark.markov_rank)

    def kv_cache_specs(self, block_size: int, dtype: str) -> list[KVSpec]:
        return [attention_spec(layer.self_attn.attn, block_size, dtype) for layer in self.layers]

    def write_context(self, features: torch.Tensor, positions: torch.Tensor,
                      caches: list[torch.Tensor], slot_mappings: list[torch.Tensor]) -> None:
        """Every draft layer's context K/V for the step's rows (``features``: the target's,
        [T, len(target_layer_ids) * hidden])."""
        main = self.main_norm(self.main_proj(features))
        for layer, cache, slots in zip(self.layers, caches, slot_mappings):
            layer.self_attn.write_context(positions, main, cache, slots)

    def forward_block(self, x: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor],
                      tables: list[torch.Tensor], masks: list[torch.Tensor]) -> torch.Tensor:
        """The blocks' final hidden states before the norm, [R * B, hidden] (``x``: their
        embeddings; ``tables``, ``masks``: per layer, as ``DSparkAttention.forward_block``)."""
        residual = None
        for layer, cache, table, mask in zip(self.layers, caches, tables, masks):
            if residual is None:
                residual, h = x, layer.input_layernorm(x)
            else:
                h, residual = layer.input_layernorm(x, residual)
            h = layer.self_attn.forward_block(positions, h, cache, table, mask)
            h, residual = layer.post_attention_layernorm(h, residual)
            x = layer.mlp(h)
        return x + residual

    def markov_embed(self, previous: torch.Tensor) -> torch.Tensor:
        """The previous tokens' Markov embeddings [R, r]."""
        return self.markov_head.embed(previous)

    def head_logits(self, hidden: torch.Tensor,
                    lm_head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The target's head (``lm_head``) on the normed final states [..., V]: a draft's
        logits are these plus its Markov term (``markov_logits``)."""
        return lm_head(self.norm(hidden.reshape(-1, hidden.shape[-1]))).view(*hidden.shape[:-1], -1)

    def markov_logits(self, embedded: torch.Tensor) -> torch.Tensor:
        """The Markov term of the previous tokens' embeddings [R, V], float32."""
        return self.markov_head.head(embedded).float()

    def confidence(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """Each row's chance its draft is accepted, [R]."""
        logit = self.confidence_head.proj(torch.cat([hidden, embedded.to(hidden.dtype)], -1))
        return torch.sigmoid(logit.float().squeeze(-1) / self.dspark.confidence_temperature)


def read_drafter_config(path: str | Path) -> dict[str, Any]:
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"speculative_config.model: {str(path)!r} has no config.json (a DSpark "
                         "drafter checkpoint is a directory)")
    hf = json.loads(config_path.read_text())
    if (hf.get("architectures") or [None])[0] != ARCHITECTURE:
        raise ValueError(f"speculative_config.model: {str(path)!r} is not a DSpark drafter "
                         f"(architectures {hf.get('architectures')}, want [{ARCHITECTURE!r}])")
    return hf


def check_drafter(hf: dict[str, Any], dspark: DSparkConfig, target: ArchConfig) -> None:
    """Refuse a drafter the target cannot feed: another width or vocabulary, a target layer
    it does not have, more rows than a block."""
    if hf["hidden_size"] != target.hidden_size or hf["vocab_size"] != target.vocab_size:
        raise ValueError(f"DSpark drafter: hidden_size {hf['hidden_size']} and vocab_size "
                         f"{hf['vocab_size']} must be the target's ({target.hidden_size}, "
                         f"{target.vocab_size}): it shares the target's embeddings and head")
    bad = [t for t in dspark.target_layer_ids if not 0 <= t < target.num_layers]
    if bad or not dspark.target_layer_ids:
        raise ValueError(f"DSpark drafter: dspark_target_layer_ids {list(dspark.target_layer_ids)} "
                         f"must name layers of the target (0 .. {target.num_layers - 1})")
    if not 0 <= dspark.noise_token_id < target.vocab_size:
        raise ValueError(f"DSpark drafter: dspark_noise_token_id {dspark.noise_token_id} is not "
                         "a token of the vocabulary")
