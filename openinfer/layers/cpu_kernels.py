"""Which layers compute through the CPU kernel extension (openinfer/kernels/cpu_attention.py):
the engine hands the extension to them once, at load, on the ``cpu`` attention backend.
Each layer keeps its torch path and takes the kernel only for the calls it covers (see each
layer's ``cpu_kernels``)."""

from __future__ import annotations

from types import ModuleType

from torch import nn

from openinfer.layers.mlp import GatedMLP
from openinfer.layers.moe import FusedExperts
from openinfer.layers.norm import RMSNorm
from openinfer.layers.rotary import RotaryEmbedding

KERNEL_LAYERS = (RMSNorm, RotaryEmbedding, GatedMLP, FusedExperts)
"""RMSNorm (with the residual add), rotary embedding, the gated MLP's SiLU-and-multiply, and
the few-row float32 expert GEMMs."""


def use_cpu_kernels(model: nn.Module, kernels: ModuleType) -> int:
    """Route the model's KERNEL_LAYERS, and its decoder stack (Llama-family layers in one call
    per step: openinfer/models/llama_cpu.py), through the CPU extension; returns how many
    modules."""
    from openinfer.models.llama import DecoderStack

    modules = [m for m in model.modules() if isinstance(m, (*KERNEL_LAYERS, DecoderStack))]
    for module in modules:
        module.cpu_kernels = kernels
    return len(modules)
