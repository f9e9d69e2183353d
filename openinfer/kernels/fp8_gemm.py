"""y = x @ W^T for a weight kept in block-scaled float8 e4m3, as DeepSeek-V3/R1 and Qwen3-FP8
checkpoints store it: ``W[i, j] = fp8[i, j] * scale[i // bn, j // bk]`` (``weight_scale_inv``,
one float32 per bn x bk tile, 128 x 128 in those releases). One byte per weight in memory
instead of two (bf16) or four (fp32): a decode step streams a half or a quarter of the bytes.

    rows                     path
    1..FP8_KERNEL_MAX_ROWS   fp8_gemm (kernels/cpu/small_gemm.cpp): small_gemm's loop reading
                             the fp8 bytes, each run of bk inputs summed and then scaled
    more, or not on a CPU    the weight dequantized for the call, a slab of rows at a time
                             (DEQUANT_SLAB_BYTES), then F.linear: at prefill sizes the GEMM's
                             arithmetic outweighs the conversion

``dequantize`` is the reference both are tested against (tests/kernels/test_fp8_gemm.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openinfer.kernels.cpu_attention import load_cpu_attention

FP8_KERNEL_MAX_ROWS = 16
"""Rows up to which the kernel runs (decode batches); benchmarks/bench_fp8_gemm.py measures
where dequantizing for the call and F.linear take over."""
DEQUANT_SLAB_BYTES = 32 << 20
"""The most bytes of dequantized weight the F.linear path holds at once."""


FP4_GROUP = 32
"""Inputs per scale of an MXFP4 weight row (DeepSeek-V4's FP4 experts)."""
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The float4 e2m1 value of each 4-bit code (bit 3: the sign)."""


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``packed`` [N, K / 2] (int8 or uint8; element 2j in byte j's low nibble, 2j + 1
    in its high one) and its scales [N, K / 32] (powers of two) -> float32 [N, K]."""
    codes = packed.view(torch.uint8)
    nibbles = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2).long()
    values = torch.tensor(E2M1_VALUES)[nibbles]
    return values * scale.float().repeat_interleave(FP4_GROUP, -1)[..., :values.shape[-1]]



def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 [N, K] and its per-tile scales [ceil(N / bn), ceil(K / bk)] -> ``dtype`` [N, K]
    (each product formed in float32, then rounded once)."""
    rows, cols = block
    n, k = weight.shape
    scales = scale.float().repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
    return (weight.float() * scales).to(dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequantize(weight, scale)^T (+ bias), in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    if (x.device.type == "cpu" and rows.shape[0] <= FP8_KERNEL_MAX_ROWS
            and x.dtype in (torch.float32, torch.bfloat16)):
        ext = load_cpu_attention()
        if ext is not None:
            out = torch.empty(rows.shape[0], weight.shape[0], dtype=x.dtype)
            ext.fp8_gemm(out, rows.contiguous(), weight, scale, block[0], block[1], bias)
            return out.view(*x.shape[:-1], weight.shape[0])
    return _dequantized_linear(x, weight, scale, block, bias)


def _dequantized_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        block: tuple[int, int], bias: torch.Tensor | None) -> torch.Tensor:
    # On a CPU in float32 (bf16 GEMMs convert element by element where the CPU has no bf16
    # instructions, and the weight is widened here anyway); elsewhere in x's dtype.
    on_cpu = x.device.type == "cpu"
    dtype = torch.float32 if on_cpu else x.dtype
    ext = load_cpu_attention() if on_cpu else None
    n, k = weight.shape
    bn = block[0]
    slab = max(bn, DEQUANT_SLAB_BYTES // (k * torch.finfo(dtype).bits // 8) // bn * bn)
    xc = x.to(dtype)

    def dequantized(rows: slice) -> torch.Tensor:
        w, s = weight[rows], scale[rows.start // bn:(rows.stop + bn - 1) // bn]
        if ext is None:
            return dequantize(w, s, block, dtype)
        out = torch.empty(w.shape, dtype=torch.float32)
        ext.fp8_dequantize(out, w, s, block[0], block[1])  # (torch's fp8 -> float32 is scalar)
        return out

    parts = [F.linear(xc, dequantized(slice(n0, min(n, n0 + slab)))) for n0 in range(0, n, slab)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    if bias is not None:
        out = out + bias.to(dtype)
    return out.to(x.dtype)
