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

FP8 experts (a block-scaled ``float8_e4m3fn`` checkpoint kept as loaded, openinfer.models.fp8)
pack their bytes as float32's, ``[E, N / tile, K, tile]``, and their scales beside them: for each
tile, one scale per ``block_k`` inputs for each half of its columns (a gate and an up half in
w13; two runs of H in w2), ``[E, N / tile, ceil(K / block_k), 2]`` float32. A half lies within
one block of ``block_n`` rows (``block_n`` a multiple of ``tile / 2``). The kernel multiplies each
weight by its scale in registers: the values of ``fp8_gemm.dequantize``.

MXFP4 experts (DeepSeek-V4's release: ``[N, K / 2]`` bytes, two e2m1 values each, the low nibble
first; one power-of-two scale per 32 inputs of each row) pack their bytes as they are, per
tile ``[E, N / tile, K / 2, tile]`` (a byte: inputs 2j and 2j + 1 of one column), and their
scales as float32 beside them, ``[E, N / tile, K / 32, tile]``: a scale per column. The kernel
turns a tile into float32 once per task (``fp8_gemm.dequantize_fp4``'s values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from openinfer.kernels.fp8_gemm import FP4_GROUP

ACTIVATIONS = {"silu": 0, "clamped_silu": 1, "clamped_swiglu": 2}
"""The kernel's activations, as FusedExperts (openinfer/layers/moe.py) names its own."""


@dataclass(frozen=True)
class Fp8Experts:
    """Stacked experts' block scales as the checkpoint gives them, per expert."""

    w13_scale: torch.Tensor
    """[E, 2, ceil(I / block_n), ceil(H / block_k)]: the gate's, then the up projection's."""
    w2_scale: torch.Tensor
    """[E, ceil(H / block_n), ceil(I / block_k)]"""
    block: tuple[int, int]


@dataclass(frozen=True)
class Fp4Experts:
    """Stacked MXFP4 experts' scales as the checkpoint gives them (float32 powers of two)."""

    w13_scale: torch.Tensor
    """[E, 2I, H / 32]: the gate's rows, then the up projection's."""
    w2_scale: torch.Tensor
    """[E, H, I / 32]"""


@dataclass(frozen=True)
class PackedExperts:
    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor | None
    b2: torch.Tensor | None
    activation: int
    alpha: float = 0.0
    limit: float = 0.0
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    block_k: int = 0


def _pad_rows(t: torch.Tensor, rows: int, dim: int, fill: float = 0.0) -> torch.Tensor:
    """``t`` padded with ``fill`` along ``dim`` to ``rows``."""
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, rows - t.shape[dim]]
    return F.pad(t, pad, value=fill) if rows > t.shape[dim] else t


def _tiles(w: torch.Tensor, tile: int) -> torch.Tensor:
    """One expert's [N, K] (N a multiple of ``tile``) in the kernel's tile layout."""
    n, k = w.shape
    tiles = w.view(n // tile, tile, k)
    if w.dtype in (torch.float32, torch.uint8):  # (fp8 is moved as bytes)
        return tiles.transpose(1, 2).contiguous()  # [N / tile, K, tile]
    return tiles.view(n // tile, tile, k // 2, 2).permute(0, 2, 1, 3).reshape(n // tile, k // 2, 2 * tile)


def pack_experts(w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None, b2: torch.Tensor | None,
                 tile: int, activation: str, alpha: float = 0.0, limit: float = 0.0,
                 fp8: Fp8Experts | None = None, fp4: Fp4Experts | None = None) -> PackedExperts:
    """The packed copy of stacked experts (w13 [E, 2I, H], w2 [E, H, I]; float8_e4m3fn with
    ``fp8``'s scales; or MXFP4 bytes [E, 2I, H / 2], [E, H, I / 2] with ``fp4``'s), one expert
    at a time so that the extra memory while packing is one expert's."""
    num, two_i, _ = w13.shape
    inter, half = two_i // 2, tile // 2
    hidden = w2.shape[1]
    ip, hp = -(-inter // half) * half, -(-hidden // tile) * tile
    if fp4 is not None and (hidden % FP4_GROUP or ip % FP4_GROUP):
        raise ValueError(f"MXFP4 experts: hidden {hidden} and intermediate {ip} sizes must be "
                         f"multiples of {FP4_GROUP}")
    bytes13, bytes2 = (w13.view(torch.uint8), w2.view(torch.uint8)) if fp8 or fp4 else (w13, w2)
    packed13, packed2 = _pack(bytes13, bytes2, inter, ip, hp, half, tile, 2 if fp4 else 1)
    biases = None, None
    if b13 is not None:
        halves = _pad_rows(b13.float().view(num, 2, inter), ip, 2).contiguous()
        biases = halves, _pad_rows(b2.float(), hp, 1).contiguous()
    scales = (None, None, 0)
    if fp8:
        packed13, packed2 = packed13.view(w13.dtype), packed2.view(w2.dtype)
        scales = _pack_scales(fp8, half, ip, hp)
    elif fp4:
        s13, s2 = _pack(fp4.w13_scale.float(), fp4.w2_scale.float(), inter, ip, hp, half, tile,
                        FP4_GROUP, fill=1.0)
        scales = (s13, s2, FP4_GROUP)
    return PackedExperts(packed13, packed2, *biases, ACTIVATIONS[activation], alpha, limit, *scales)


def _pack(w13: torch.Tensor, w2: torch.Tensor, inter: int, ip: int, hp: int, half: int, tile: int,
          per_column: int, fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H / per_column] and w2 [E, H, I / per_column] (a column: that many inputs)
    in tiles, gate and up features side by side in w13's; padding ``fill``."""
    num, cols = w13.shape[0], w13.shape[2]
    packed13 = packed2 = None
    for e in range(num):
        gate = _pad_rows(w13[e, :inter], ip, 0, fill).view(ip // half, half, cols)
        up = _pad_rows(w13[e, inter:], ip, 0, fill).view(ip // half, half, cols)
        t13 = _tiles(torch.cat([gate, up], dim=1).view(2 * ip, cols), tile)
        t2 = _tiles(_pad_rows(_pad_rows(w2[e], -(-ip // per_column), 1, fill), hp, 0, fill), tile)
        if packed13 is None:
            packed13 = t13.new_empty(num, *t13.shape)
            packed2 = t2.new_empty(num, *t2.shape)
        packed13[e], packed2[e] = t13, t2
    return packed13, packed2


def _pack_scales(fp8: Fp8Experts, half: int, ip: int, hp: int,
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``fp8``'s scales as the kernel reads them: for each tile and run of block_k inputs,
    the scale of each half of its columns (packing's layout, in the module docstring)."""
    bn, bk = fp8.block
    if bn % half:
        raise ValueError(f"fp8 experts: block_n {bn} is not a multiple of the kernel's "
                         f"{half} columns per half tile")
    s13, s2 = fp8.w13_scale.float(), fp8.w2_scale.float()
    # w13 tile j: features j*half .. of the gate (half 0) and of up (half 1).
    rows13 = (torch.arange(ip // half) * half // bn).clamp(max=s13.shape[2] - 1)
    packed13 = s13[:, :, rows13].permute(0, 2, 3, 1).contiguous()
    # w2 tile j, half n: output features j*2*half + n*half ..; inputs padded to ip.
    rows2 = ((torch.arange(hp // half) * half) // bn).clamp(max=s2.shape[1] - 1)
    per_tile = s2[:, rows2].view(s2.shape[0], hp // (2 * half), 2, s2.shape[2])
    packed2 = _pad_rows(per_tile, -(-ip // bk), 3).permute(0, 1, 3, 2).contiguous()
    return packed13, packed2, bk


def fused_moe(kernels, packed: PackedExperts, x: torch.Tensor, weights: torch.Tensor,
              slots: torch.Tensor, bf16_dot: str = "") -> torch.Tensor:
    """sum_j weights[t, j] * expert_{slots[t, j]}(x[t]) for every token t (x [T, H]; weights
    and slots [T, k]; a slot outside 0 .. E-1 is another rank's and adds nothing).
    ``bf16_dot``: the bf16 product path ("fp32", "avx512_bf16" where compiled; "": the build's
    best; "amx_bf16" runs VDPBF16PS, there are no AMX tiles here)."""
    return kernels.fused_moe(x.contiguous(), packed.w13, packed.w2, weights.float().contiguous(),
                             slots.long().contiguous(), packed.b13, packed.b2, packed.activation,
                             packed.alpha, packed.limit, bf16_dot, packed.w13_scale,
                             packed.w2_scale, packed.block_k)
