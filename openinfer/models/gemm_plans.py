"""A loaded CPU model's GEMM plans (openinfer/kernels/gemm_plan.py): ``plan_gemms`` gives every
GemmLayer the plan made for its weight; ``describe_gemms`` says what they chose, for the load log
and the compute_info metric."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from openinfer.cpu_features import last_level_cache_bytes
from openinfer.kernels.gemm_plan import (
    BUCKETS,
    DEFAULT_CACHE_BYTES,
    cache_flusher,
    extra_copy_budget,
    gemm_mode,
    plan_weight,
    why_no_plans,
)
from openinfer.layers.linear import GemmLayer


def plan_gemms(model: nn.Module, mode: str | None = None) -> None:
    """Give every GemmLayer of a loaded CPU ``model`` a GEMM plan (``mode``: see
    ``gemm_mode``). Does nothing where ``why_no_plans`` gives a reason."""
    mode = gemm_mode(mode)
    # (a layer holding fp8 weights runs its own GEMMs: openinfer.kernels.fp8_gemm)
    layers = [m for m in model.modules() if isinstance(m, GemmLayer) and m.fp8_block is None]
    if why_no_plans(layers[0].weight if layers else None, mode) is not None:
        return
    owners = weight_owners(model)
    cache = last_level_cache_bytes() or DEFAULT_CACHE_BYTES
    cold = sum(m.weight.numel() * m.weight.element_size() for m in layers) > cache
    flush = cache_flusher() if cold and mode == "auto" else None
    budget = extra_copy_budget()
    with torch.no_grad():
        for layer in layers:
            weight = layer.weight.data
            shared = owners[id(layer.weight)] > 1
            layer.plan = plan_weight(weight, None if layer.bias is None else layer.bias.data, mode,
                                     shared, flush=flush,
                                     may_copy=weight.numel() * weight.element_size() <= budget,
                                     timed_buckets=layer.timed_buckets)
            budget -= layer.plan.extra_bytes
            if not layer.plan.reads_plain and not shared:
                free_plain_weight(layer)


def weight_owners(model: nn.Module) -> dict[int, int]:
    """id(parameter) -> how many modules hold it (two for a tied embedding and LM head)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return owners


def free_plain_weight(layer: GemmLayer) -> None:
    """Nothing reads the layer's loaded weight any more (its plan holds a packed copy): a meta
    tensor of the same shape takes its place (``parameters()`` still counts it; reading it
    fails)."""
    layer.weight = nn.Parameter(torch.empty_like(layer.weight, device="meta"), requires_grad=False)


@dataclass(frozen=True)
class GemmSummary:
    """What the plans of a model chose, for the load log and the compute_info metric."""

    label: str
    """The paths in use, '+'-joined ('default' when no plans: CUDA, or switched off)."""
    text: str
    """One line: per bucket the paths (path:layers where layers differ) and the speedup over
    F.linear (time-weighted over layers), extra bytes, planning seconds."""
    extra_bytes: int
    seconds: float


def describe_gemms(model: nn.Module, mode: str | None = None) -> GemmSummary:
    """The summary of ``model``'s plans (``mode``: as given to ``plan_gemms``, for the reason
    when there are none)."""
    layers = [m for m in model.modules() if isinstance(m, GemmLayer)]
    fp8 = sum(m.fp8_block is not None for m in layers)
    held = f"; {fp8} layers hold fp8 weights" if fp8 else ""
    layers = [m for m in layers if m.fp8_block is None]
    plans = [m.plan for m in layers if m.plan is not None]
    if not plans:
        reason = why_no_plans(layers[0].weight if layers else None, gemm_mode(mode)) or "not planned"
        return GemmSummary("default" + ("+fp8" if fp8 else ""), f"linear() ({reason}){held}", 0, 0.0)
    used = sorted({name for plan in plans for name in plan.paths})
    extra = sum(plan.extra_bytes for plan in plans)
    seconds = sum(plan.seconds for plan in plans)
    if any(plan.invariant_sizes for plan in plans):  # --batch-invariant
        sizes = sorted({s for plan in plans for s in plan.invariant_sizes})
        text = (f"batch-invariant: {', '.join(used)} on {sizes[0]}..{sizes[-1]}-row chunks; "
                f"extra weight copies {extra / 2**20:.0f} MiB; planned in {seconds:.2f} s")
        return GemmSummary("invariant:" + "+".join(used), text, extra, seconds)
    parts = []
    for i, bucket in enumerate(BUCKETS):
        routes = [plan.routes[i] for plan in plans]
        counts: dict[str, int] = {}
        for r in routes:
            counts[r.path.name] = counts.get(r.path.name, 0) + 1
        names = " ".join(name if len(counts) == 1 else f"{name}:{n}"
                         for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        timed = [r for r in routes if r.seconds is not None and r.torch_seconds is not None]
        speedup = (f" {sum(r.torch_seconds for r in timed) / sum(r.seconds for r in timed):.2f}x"
                   if timed else "")
        parts.append(f"{bucket} {names}{speedup}")
    text = (f"{', '.join(parts)} (vs F.linear); extra weight copies {extra / 2**20:.0f} MiB; "
            f"planned in {seconds:.2f} s{held}")
    return GemmSummary("+".join(used + (["fp8"] if fp8 else [])), text, extra, seconds)

