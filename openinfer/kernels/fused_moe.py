"""The CPU extension's fused MoE (``cpu/fused_moe.cpp``): a layer's routed experts in one call,
on expert weights packed once at load.

Packing: the kernel's weight tiles are runs of memory of ``tile`` output columns
(``fused_moe_tile()`` of the build: twice its vector width). A ``[E, N, K]`` stack becomes
``[E, N / tile, K, tile]`` in float32, and ``[E, N / tile, K / 2, 2 * tile]`` in bfloat16 (two
consecutive inputs side by side, VDPBF16PS's operand layout)::

    w13 [E, 2I, H]: gate rows 0 .. I, up rows I .. 2I
    tile j of w13:  | gate j*tile/2 .. (j+1)*tile/2 | up, the same features |
    tile j of w2:   output columns j*tile .. (j+1)*tile

so one tile of w13 gives the gate and up values of the same features, and the kernel applies
the activation in registers. I is padded to a multiple of ``tile / 2`` and H (w2's rows) to a
multiple of ``tile`` with zero weights (whose products are zero and never stored). Biases
become float32 ``[E, 2, I]`` and ``[E, H]``, padded alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ACTIVATIONS = {"silu": 0, "clamped_silu": 1, "clamped_swiglu": 2}
"""The kernel's activations, as FusedExperts (openinfer/layers/moe.py) names its own."""


@dataclass(frozen=True)
class PackedExperts:
    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor | None
    b2: torch.Tensor | None
    activation: int
    alpha: float = 0.0
    limit: float = 0.0


def _pad_rows(t: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
    """``t`` zero-padded along ``dim`` to ``rows``."""
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, rows - t.shape[dim]]
    return F.pad(t, pad) if rows > t.shape[dim] else t


def _tiles(w: torch.Tensor, tile: int) -> torch.Tensor:
    """One expert's [N, K] (N a multiple of ``tile``) in the kernel's tile layout."""
    n, k = w.shape
    tiles = w.view(n // tile, tile, k)
    if w.dtype == torch.float32:
        return tiles.transpose(1, 2).contiguous()  # [N / tile, K, tile]
    return tiles.view(n // tile, tile, k // 2, 2).permute(0, 2, 1, 3).reshape(n // tile, k // 2, 2 * tile)


def pack_experts(w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None, b2: torch.Tensor | None,
                 tile: int, activation: str, alpha: float = 0.0, limit: float = 0.0) -> PackedExperts:
    """The packed copy of stacked experts (w13 [E, 2I, H], w2 [E, H, I]), one expert at a time
    so that the extra memory while packing is one expert's."""
    num, two_i, hidden = w13.shape
    inter, half = two_i // 2, tile // 2
    ip, hp = -(-inter // half) * half, -(-hidden // tile) * tile
    packed13 = packed2 = None
    for e in range(num):
        gate = _pad_rows(w13[e, :inter], ip, 0).view(ip // half, half, hidden)
        up = _pad_rows(w13[e, inter:], ip, 0).view(ip // half, half, hidden)
        t13 = _tiles(torch.cat([gate, up], dim=1).view(2 * ip, hidden), tile)
        t2 = _tiles(_pad_rows(_pad_rows(w2[e], ip, 1), hp, 0), tile)
        if packed13 is None:
            packed13 = t13.new_empty(num, *t13.shape)
            packed2 = t2.new_empty(num, *t2.shape)
        packed13[e], packed2[e] = t13, t2
    biases = None, None
    if b13 is not None:
        halves = _pad_rows(b13.float().view(num, 2, inter), ip, 2).contiguous()
        biases = halves, _pad_rows(b2.float(), hp, 1).contiguous()
    return PackedExperts(packed13, packed2, *biases, ACTIVATIONS[activation], alpha, limit)


def fused_moe(kernels, packed: PackedExperts, x: torch.Tensor, weights: torch.Tensor,
              slots: torch.Tensor, bf16_dot: str = "") -> torch.Tensor:
    """sum_j weights[t, j] * expert_{slots[t, j]}(x[t]) for every token t (x [T, H]; weights
    and slots [T, k]; a slot outside 0 .. E-1 is another rank's and adds nothing).
    ``bf16_dot``: the bf16 product path ("fp32", "avx512_bf16" where compiled; "": the build's
    best; "amx_bf16" runs VDPBF16PS, there are no AMX tiles here)."""
    return kernels.fused_moe(x.contiguous(), packed.w13, packed.w2, weights.float().contiguous(),
                             slots.long().contiguous(), packed.b13, packed.b2, packed.activation,
                             packed.alpha, packed.limit, bf16_dot)
