"""Qwen2: Llama blocks with a bias on the q/k/v projections (none on o_proj)."""

from __future__ import annotations

from openinfer.models.arch import ArchConfig
from openinfer.models.llama import BlockVariant, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def block_variant(cls, arch: ArchConfig) -> BlockVariant:
        return BlockVariant(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)
