"""A Llama-family model's decoder layers in one C++ call per step, on the cpu attention
backend (``DecoderLayers``, openinfer/kernels/cpu/decoder_layers.cpp).

Why: the Python between two kernels runs with cold caches, the kernel before it having
streamed weights or K/V through L2. A segment that takes 2.4 us hot took ~30 us after a
4 MiB sweep, and a batch-32 decode step of a 16-layer model had ~130 such segments: 6.2 ms of
a 60 ms step (2026-12-05, benchmarks/bench_step_overhead.py). The one call runs each layer's
kernels in the Python layers' order, with the GEMM path each plan routes the step's row count
to: the same bits.

Covered: every layer a ``DecoderLayer`` of ``LlamaAttention`` (q/k norms or none, RoPE over
whole heads, a window, softcap or sinks) and a SiLU ``GatedMLP``, on one tensor-parallel rank,
with any GEMM plan (AMX, MKL, small_gemm, oneDNN, torch's own; prefill-sized calls padded as
the plan pads them), and fp8 weights kept as loaded (steps of up to FP8_KERNEL_MAX_ROWS rows:
the fp8 kernel). Anything else runs the Python layers, which call the same kernels one by
one.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Protocol

import torch
from torch import nn

from openinfer.attention.base import AttentionMetadata
from openinfer.attention.cpu import attention_step, rope_kernel
from openinfer.kernels.fp8_gemm import FP8_KERNEL_MAX_ROWS
from openinfer.kernels.gemm_plan import PAD_FROM_ROWS, PAD_ROWS
from openinfer.layers.linear import GemmLayer
from openinfer.layers.mlp import GatedMLP
from openinfer.layers.norm import RMSNorm

LlamaBlock = tuple[RMSNorm, Any, RMSNorm, GatedMLP]
"""A layer's input norm, attention (``LlamaAttention``), post-attention norm and MLP."""


class FusableStack(Protocol):
    """A decoder stack (``models.llama.DecoderStack``) as this call reads it."""

    layers: nn.ModuleList
    cpu_layers: dict[torch.dtype, object]
    """The call per activation dtype (None: not covered), made at the first step."""

    def llama_blocks(self) -> list[LlamaBlock] | None:
        """Each layer's parts where every layer is a plain Llama block, else None."""


def run_layers(stack: FusableStack, kernels: ModuleType, positions: torch.Tensor, x: torch.Tensor,
               caches: list[torch.Tensor], metas: list[AttentionMetadata], keep: tuple[int, ...] = ()
               ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]] | None:
    """(x, residual) after the stack's last layer, and the hidden states entering the layers
    ``keep`` (ascending), in one C++ call; None where the call does not cover this model or
    this step (the caller then runs the layers in Python)."""
    n = len(stack.layers)
    if len(caches) < n or len(metas) < n:
        return None
    caches, metas = caches[:n], metas[:n]  # (a draft model is handed the runner's rest)
    layers = stack.cpu_layers.get(x.dtype, _UNDECIDED)
    if layers is _UNDECIDED:
        blocks = stack.llama_blocks()
        layers = stack.cpu_layers[x.dtype] = (None if blocks is None
                                              else _build(blocks, kernels, x.dtype, caches))
    if layers is None or not layers.covers(x.shape[0]):
        return None
    for meta in metas:
        if meta.context_parallel is not None:
            return None
    return layers(x, caches, [attention_step(meta, positions) for meta in metas], list(keep))


_UNDECIDED = object()


def _build(blocks: list[LlamaBlock], kernels: ModuleType, dtype: torch.dtype,
           caches: list[torch.Tensor]):
    """The blocks' ``DecoderLayers``, or None where some layer is not covered."""
    paths = dict(kernels.GEMM_PATHS)

    def gemm(linear: GemmLayer):
        plan = linear.plan
        if getattr(linear, "tp", None) is not None and linear.tp.size > 1:
            return None
        if linear.fp8_block is not None:  # fp8_linear's kernel rows; more run the Python layers
            routes = [(FP8_KERNEL_MAX_ROWS, paths["fp8"], linear.weight, False),
                      (2**62, -1, linear.weight, False)]
            return kernels.Gemm(routes, linear.bias, PAD_FROM_ROWS, PAD_ROWS,
                                linear.weight_scale_inv, *linear.fp8_block)
        if plan is None:
            return None
        routes = [(min(max_rows, 2**62), paths.get(route.path.name, -1), weight, pads)
                  for (max_rows, _, weight, pads), route in zip(plan._table, plan.routes)]
        return kernels.Gemm(routes, plan.bias, PAD_FROM_ROWS, PAD_ROWS)

    built = []
    for (input_norm, attn, post_norm, mlp), cache in zip(blocks, caches):
        norms = (input_norm, post_norm)
        # Each part bound to its CPU kernel path (not batch-invariant mode's, nor torch's).
        if (not attn.attn.fuses_rope or mlp.forward_path != "forward_cpu"
                or mlp.activation != "silu" or mlp.clamp_limit is not None
                or any(n.forward_path != "forward_cpu" or n.weight.dtype != dtype for n in norms)):
            return None
        q_norm, k_norm = (attn.q_norm, attn.k_norm) if attn.qk_norm else (None, None)
        attention = rope_kernel(attn.attn, dtype, attn.rotary, q_norm, k_norm, cache)
        gemms = [gemm(g) for g in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if attention is None or None in gemms:
            return None
        built.append(kernels.DecoderLayer(norms[0].weight, norms[0].eps, norms[1].weight, norms[1].eps,
                                          *gemms, attention))
    return kernels.DecoderLayers(built) if built else None
