"""Qwen3: Llama blocks with RMSNorm applied to every head's q and k before RoPE."""

from __future__ import annotations

from openinfer.models.arch import ArchConfig
from openinfer.models.llama import BlockVariant, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def block_variant(cls, arch: ArchConfig) -> BlockVariant:
        bias = arch.attention_bias
        return BlockVariant(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)
