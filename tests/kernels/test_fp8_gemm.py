"""The fp8 GEMM (openinfer/kernels/fp8_gemm.py) against its reference: the weight dequantized
(fp8 value times its tile's scale, in float32) and F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from openinfer.kernels import fp8_gemm
from openinfer.kernels.cpu_attention import build_lane_twin
from openinfer.kernels.fp8_gemm import dequantize, fp8_linear

NAN_BYTES = (0x7F, 0xFF)
"""e4m3fn's NaN encodings: never in a checkpoint, and the kernel does not read them as NaN."""


def _quantized(n: int, k: int, block: tuple[int, int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 0.02 + 1e-3
    return weight, scale


@pytest.mark.parametrize("k", [16, 13])  # vector loads; the scalar tail
def test_every_fp8_value_is_read_exactly(kernels, k):
    """Row i of W holds byte i in every column, x is one-hot: out[i] is byte i's value times
    its scale, for every normal and subnormal e4m3 number and both zeros."""
    codes = torch.tensor([b for b in range(256) if b not in NAN_BYTES], dtype=torch.uint8)
    weight = codes[:, None].expand(-1, k).contiguous().view(torch.float8_e4m3fn)
    scale = torch.ones(len(codes), 1)
    x = torch.zeros(1, k)
    x[0, k - 1] = 1.0
    out = torch.empty(1, len(codes))
    kernels.fp8_gemm(out, x, weight, scale, 1, k, None)
    assert torch.equal(out[0], weight[:, 0].float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [(128, 128), (16, 16), (48, 32)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16])
def test_kernel_matches_the_dequantized_reference(kernels, dtype, block, rows):
    for n, k, bias in ((37, 100, True), (300, 256, False), (130, 513, True)):
        weight, scale = _quantized(n, k, block, seed=n + k)
        x = torch.randn(rows, k).to(dtype)
        b = torch.randn(n).to(dtype) if bias else None
        out = torch.empty(rows, n, dtype=dtype)
        kernels.fp8_gemm(out, x, weight, scale, block[0], block[1], b)
        want = F.linear(x.float(), dequantize(weight, scale, block), None if b is None else b.float())
        bf16 = dtype == torch.bfloat16  # (rounded once, from float32 sums)
        torch.testing.assert_close(out.float(), want.to(dtype).float(), rtol=1e-2 if bf16 else 2e-5,
                                   atol=1e-2 if bf16 else 1e-4)


@pytest.mark.parametrize("rows", [1, fp8_gemm.FP8_KERNEL_MAX_ROWS, fp8_gemm.FP8_KERNEL_MAX_ROWS + 1, 64])
def test_fp8_linear_on_both_paths_and_several_slabs(monkeypatch, rows):
    """Past FP8_KERNEL_MAX_ROWS, the weight is dequantized a slab of rows at a time (a small
    slab forces several here, the last one partial)."""
    monkeypatch.setattr(fp8_gemm, "DEQUANT_SLAB_BYTES", 40 * 256 * 4)
    block = (16, 64)
    weight, scale = _quantized(200, 256, block)
    x, bias = torch.randn(rows, 256), torch.randn(200)
    got = fp8_linear(x, weight, scale, block, bias)
    want = F.linear(x, dequantize(weight, scale, block), bias)
    assert got.shape == (rows, 200)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-4)


def test_the_kernel_refuses_mismatched_scales(kernels):
    weight, scale = _quantized(64, 64, (32, 32))
    with pytest.raises(RuntimeError, match="scales"):
        kernels.fp8_gemm(torch.empty(1, 64), torch.randn(1, 64), weight, scale, 16, 32, None)


@pytest.mark.parametrize("block", [(128, 128), (16, 16), (48, 32)])
def test_dequantize_kernel_gives_the_reference_values(kernels, block):
    """What the F.linear path multiplies: bit for bit the reference's products."""
    for n, k in ((37, 100), (300, 256), (130, 13)):
        weight, scale = _quantized(n, k, block, seed=n * k)
        out = torch.empty(n, k)
        kernels.fp8_dequantize(out, weight, scale, block[0], block[1])
        assert torch.equal(out, dequantize(weight, scale, block))


@pytest.mark.slow
def test_other_lane_width_build_reads_e4m3_without_f16c(kernels):
    """The lane twin (the vector width this CPU's build does not use) converts e4m3 from its
    bits, as a CPU without F16C does: the same values, the same products."""
    other = build_lane_twin(kernels)
    test_every_fp8_value_is_read_exactly(other, 16)
    test_every_fp8_value_is_read_exactly(other, 13)
    test_dequantize_kernel_gives_the_reference_values(other, (16, 16))
    for rows in (1, 3, 16):
        test_kernel_matches_the_dequantized_reference(other, torch.bfloat16, (48, 32), rows)
