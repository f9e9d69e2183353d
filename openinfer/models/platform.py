"""Binding a loaded model to this machine, once, at load: ``bind_platform`` chooses each
layer's path (openinfer/kernels/custom_op.py: the torch path, the CPU extension's, CUDA's, or
batch-invariant mode's); ``make_batch_invariant`` checks a model can run in that mode and gives
its linear layers batch-invariant GEMM plans (openinfer/kernels/invariant_gemm.py). The
ordinary GEMM plans are made by ``plan_gemms`` (openinfer/models/gemm_plans.py)."""

from __future__ import annotations

import torch
from torch import nn

from openinfer.kernels.custom_op import CustomOp, Platform
from openinfer.kernels.invariant_gemm import plan_invariant_gemm
from openinfer.layers.attention import Attention
from openinfer.layers.linear import GemmLayer
from openinfer.layers.mla import MLAAttention
from openinfer.layers.moe import FusedExperts
from openinfer.models.gemm_plans import free_plain_weight, weight_owners


def bind_platform(model: nn.Module, platform: Platform) -> int:
    """Bind every CustomOp of ``model`` to ``platform``; returns how many."""
    ops = [m for m in model.modules() if isinstance(m, CustomOp)]
    for op in ops:
        op.bind(platform)
    return len(ops)


def make_batch_invariant(model: nn.Module) -> None:
    """Check a loaded CPU ``model`` can run in batch-invariant mode and give its linear layers
    batch-invariant GEMM plans; ``bind_platform`` with ``batch_invariant`` then binds its
    layers' invariant paths."""
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
