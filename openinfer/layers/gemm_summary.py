"""What a model's GEMM plans chose (openinfer/layers/gemm.py), for the load log and the
compute_info metric."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from openinfer.layers.gemm import BUCKETS, gemm_mode, why_no_plans
from openinfer.layers.linear import GemmLayer


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
    plans = [m.plan for m in layers if m.plan is not None]
    if not plans:
        reason = why_no_plans(layers, gemm_mode(mode)) or "not planned"
        return GemmSummary("default", f"linear() ({reason})", 0, 0.0)
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
            f"planned in {seconds:.2f} s")
    return GemmSummary("+".join(used), text, extra, seconds)

