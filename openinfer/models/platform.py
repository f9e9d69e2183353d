"""Binding a loaded model to this machine's kernels, once, at load: the passes that route
layers through the CPU extension (``use_cpu_kernels``; each layer keeps its torch path and
takes a kernel only for the calls it covers) and put a model in batch-invariant mode
(``make_batch_invariant``, openinfer/kernels/invariant_gemm.py). The GEMM plans are made by
``plan_gemms`` (openinfer/kernels/gemm_plan.py)."""

from __future__ import annotations

import functools
from types import ModuleType

import torch
from torch import nn

from openinfer.kernels.invariant_gemm import plan_invariant_gemm
from openinfer.layers.attention import Attention
from openinfer.layers.linear import GemmLayer
from openinfer.layers.mla import MLAAttention
from openinfer.layers.mlp import GatedMLP
from openinfer.layers.moe import FusedExperts
from openinfer.layers.norm import RMSNorm
from openinfer.layers.rotary import RotaryEmbedding
from openinfer.models import llama_cpu
from openinfer.models.gemm_plans import free_plain_weight, weight_owners
from openinfer.models.llama import DecoderStack

KERNEL_LAYERS = (RMSNorm, RotaryEmbedding, GatedMLP, FusedExperts)
"""RMSNorm (with the residual add), rotary embedding, the gated MLP's SiLU-and-multiply, and
the few-row float32 expert GEMMs."""


def use_cpu_kernels(model: nn.Module, kernels: ModuleType) -> int:
    """Route the model's KERNEL_LAYERS through the CPU extension, and run its decoder stacks
    (Llama-family layers) in one C++ call per step where that call covers them
    (openinfer/models/llama_cpu.py); returns how many modules."""
    modules = [m for m in model.modules() if isinstance(m, KERNEL_LAYERS)]
    for module in modules:
        module.cpu_kernels = kernels
    stacks = [m for m in model.modules() if isinstance(m, DecoderStack)]
    for stack in stacks:
        stack.fused_layers = functools.partial(llama_cpu.run_layers, stack, kernels)
    return len(modules) + len(stacks)


def make_batch_invariant(model: nn.Module) -> None:
    """Put a loaded CPU ``model`` in batch-invariant mode (see the module docstring)."""
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"batch_invariant: supported on CPU only, not on {device.type}")
    for module in model.modules():
        # Their expert GEMMs and latent attention have no invariant paths yet.
        if isinstance(module, (MLAAttention, FusedExperts)):
            raise ValueError(f"batch_invariant: not supported for {type(model).__name__} "
                             f"({type(module).__name__} layers)")
        if isinstance(module, Attention) and module.is_variant:
            raise ValueError(f"batch_invariant: not supported for {type(model).__name__} "
                             "(sliding-window, soft-capped or sinked attention)")
    owners = weight_owners(model)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, GemmLayer):
                shared = owners[id(module.weight)] > 1
                bias = None if module.bias is None else module.bias.data
                module.plan = plan_invariant_gemm(module.weight.data, bias, shared)
                if not module.plan.reads_plain and not shared:
                    free_plain_weight(module)
            elif isinstance(module, (Attention, GatedMLP)):
                module.batch_invariant = True
