"""gpt-oss: pre-norm blocks of GQA attention with attention sinks, sliding-window and full
layers alternating (``layer_types``), and a top-k mixture of experts with biased experts and a
clamped SwiGLU.

    x ─ embed ─┬─ RMSNorm ─ Attention (+ sinks; window W on sliding layers) ─(+)─┬─ RMSNorm ─ MoE ─(+)─ ...
               └─────────────────────────────────────────────────────────────────┘

Router: the top-k of ``router(x)`` (a biased linear), weighted by a softmax over those k.
Experts: ``down(act(gate(x), up(x)))`` with biases, ``act`` = ``ClampedSwiGLU``. The
checkpoint stores each layer's experts stacked, gate and up columns interleaved
(``gate_up_proj [E, H, 2I]``); they load into the stacked ``[E, 2I, H]`` layout of
``FusedExperts``. MXFP4-quantized checkpoints (the published ones) are refused at load
(``quantization_config``); bf16/fp32 checkpoints load.
"""

from __future__ import annotations

import torch
from torch import nn

from openinfer.layers.moe import ClampedSwiGLU, FusedExperts
from openinfer.layers.moe_router import Router, RoutingConfig
from openinfer.models.arch import ArchConfig
from openinfer.models.llama import BlockVariant, LlamaForCausalLM


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate/up columns alternating -> [..., 2I] gate columns then up columns."""
    return torch.cat([t[..., ::2], t[..., 1::2]], dim=-1)


class GptOssMoE(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        hidden, inter, experts = arch.hidden_size, arch.intermediate_size, arch.moe.num_experts
        self.router = Router(hidden, RoutingConfig(num_experts=experts, top_k=arch.moe.top_k,
                                                   scoring="topk_softmax", bias=True))
        # gpt-oss alone clamps its SwiGLU this way: its keys, with its reference's defaults.
        swiglu = ClampedSwiGLU(arch.raw.get("swiglu_alpha", 1.702), arch.raw.get("swiglu_limit", 7.0))
        self.experts = FusedExperts(experts, hidden, inter, bias=True, activation=swiglu)
        e = self.experts
        e.w13.weight_loader = lambda p, t: p.copy_(_deinterleave(t).transpose(1, 2))
        e.b13.weight_loader = lambda p, t: p.copy_(_deinterleave(t))
        e.w2.weight_loader = lambda p, t: p.copy_(t.transpose(1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        return self.experts(x, weights, ids)


class GptOssForCausalLM(LlamaForCausalLM):
    supports_tensor_parallel = False  # (its experts are not sharded yet)
    supports_context_parallel = False  # (its sliding-window layers and sinks)
    # The stacked expert tensors and the sinks under our module names.
    checkpoint_renames = {"gate_up_proj": "w13", "gate_up_proj_bias": "b13", "down_proj": "w2",
                          "down_proj_bias": "b2", "sinks": "attn.sinks"}
    expert_weights = {"gate_up_proj": ("w13", 0)}
    """Marks the model as a mixture of experts for the loader (GGUF refusal); the checkpoint's
    experts are stacked already, so no per-expert name ever matches."""

    @classmethod
    def block_variant(cls, arch: ArchConfig) -> BlockVariant:
        bias = bool(arch.raw.get("attention_bias", True))  # on unless the config says (reference)
        return BlockVariant(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False,
                            attention_sinks=True)

    @classmethod
    def make_mlp(cls, arch: ArchConfig, layer: int) -> nn.Module:
        return GptOssMoE(arch)
