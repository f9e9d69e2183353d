"""The CPU extension's fused MoE kernel against FusedExperts' torch path (its oracle): float32
within rounding, bfloat16 closer to the float32 result than the torch path itself; token counts
from a decode to a prefill, experts nobody chose, a slot repeated in a token's top-k, biases and
every activation; each bf16 product path of the build, and the other vector width's build;
block-scaled fp8 experts, read as loaded."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import mxfp4, quantize_blocks

from openinfer.kernels.cpu_attention import bf16_dot_paths, build_lane_twin
from openinfer.kernels.custom_op import Platform
from openinfer.kernels.fp8_gemm import dequantize, dequantize_fp4
from openinfer.kernels.fused_moe import fused_moe
from openinfer.layers import moe
from openinfer.layers.moe import ClampedSiluAndMul, ClampedSwiGLU, FusedExperts, silu_and_mul
from openinfer.models.platform import bind_platform

ACTIVATIONS = {"silu": silu_and_mul, "clamped_silu": ClampedSiluAndMul(0.8),
               "clamped_swiglu": ClampedSwiGLU(1.702, 0.9)}
"""Limits small enough that the clamps bind on these random values."""


def _experts(num: int, hidden: int, inter: int, dtype: torch.dtype, bias: bool = False,
             activation=silu_and_mul) -> FusedExperts:
    experts = FusedExperts(num, hidden, inter, bias=bias, activation=activation)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(std=hidden ** -0.5)
    return experts.to(dtype)


def _bound(experts: FusedExperts, kernels) -> FusedExperts:
    fused = copy.deepcopy(experts)
    bind_platform(fused, Platform("cpu", kernels))
    assert fused.forward_path == "forward_cpu" and fused.w13.is_meta  # one copy: the packed one
    return fused


def _routing(tokens: int, num: int, top_k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k choices that never pick expert 1, and give token 0 one slot twice."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num, generator=gen)[:top_k] for _ in range(tokens)])
    ids[ids == 1] = 0
    ids[0, -1] = ids[0, 0]
    return torch.rand(tokens, top_k, generator=gen), ids


def _check(fused: FusedExperts, oracle: FusedExperts, x, weights, ids) -> None:
    got = fused(x, weights, ids)
    assert got.dtype == x.dtype and got.shape == x.shape
    if x.dtype == torch.float32:
        torch.testing.assert_close(got, oracle(x, weights, ids), atol=2e-5, rtol=1e-5)
        return
    # bf16: the torch path rounds after each GEMM, the activation and every expert's add; the
    # kernel rounds h and the sum once each. Against float32 on the same (bf16) weights it is
    # at least as close as the torch path, and within a few bf16 steps of the output's scale.
    want = copy.deepcopy(oracle).float()(x.float(), weights, ids)
    err = (got.float() - want).abs().max()
    torch_err = (oracle(x, weights, ids).float() - want).abs().max()
    assert err <= torch_err * 1.01 + 1e-6
    assert err <= 2 ** -6 * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 33, 300])
def test_matches_the_torch_path(kernels, dtype, tokens):
    torch.manual_seed(tokens)
    oracle = _experts(8, 64, 48, dtype)
    fused = _bound(oracle, kernels)
    weights, ids = _routing(tokens, 8, 3)
    _check(fused, oracle, torch.randn(tokens, 64).to(dtype), weights, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_biases_activations_and_padded_shapes(kernels, dtype, activation):
    """Sizes that are no multiple of a tile (hidden 30, intermediate 20: zero padding in the
    packed weights), biases, and each activation the kernel has."""
    torch.manual_seed(1)
    oracle = _experts(5, 30, 20, dtype, bias=True, activation=ACTIVATIONS[activation])
    fused = _bound(oracle, kernels)
    for tokens in (1, 33):
        weights, ids = _routing(tokens, 5, 2, seed=tokens)
        _check(fused, oracle, torch.randn(tokens, 30).to(dtype) * 2, weights, ids)


def test_slots_of_another_rank_add_nothing(kernels):
    """Expert parallel hands the kernel ``num_slots`` for pairs another rank computes."""
    torch.manual_seed(2)
    oracle = _experts(4, 32, 16, torch.float32)
    fused = _bound(oracle, kernels)
    x, weights = torch.randn(6, 32), torch.rand(6, 2)
    slots = torch.tensor([[0, 4], [4, 4], [1, 2], [3, 4], [2, 1], [4, 0]])
    got = fused.forward_cpu(x, weights, slots)
    torch.testing.assert_close(got, oracle.forward_native(x, weights, slots), atol=2e-5, rtol=1e-5)
    assert torch.equal(got[1], torch.zeros(32))


def test_rows_do_not_depend_on_the_batch(kernels):
    """Each pair's products run over all of K in one order and each token's pairs are summed in
    top-k order: a token's output is bitwise the same alone or in a prefill."""
    torch.manual_seed(3)
    fused = _bound(_experts(8, 64, 48, torch.bfloat16), kernels)
    weights, ids = _routing(40, 8, 3)
    x = torch.randn(40, 64).bfloat16()
    together = fused(x, weights, ids)
    for t in (0, 17, 39):
        assert torch.equal(fused(x[t:t + 1], weights[t:t + 1], ids[t:t + 1]), together[t:t + 1])


def test_what_the_kernel_does_not_compute_stays_on_torch(kernels):
    """An activation the kernel does not have, float16, and a bf16 odd hidden size keep the
    torch path and their plain weights."""
    custom = _experts(4, 32, 16, torch.float32, activation=lambda g, u: g * u)
    for experts in (custom, _experts(4, 32, 16, torch.float16), _experts(4, 31, 16, torch.bfloat16)):
        bind_platform(experts, Platform("cpu", kernels))
        assert experts.forward_path == "forward_native" and not experts.w13.is_meta


@pytest.mark.parametrize("path", ["fp32", "avx512_bf16"])
def test_each_bf16_product_path(kernels, path):
    """VDPBF16PS where the build has it, float32 FMAs on widened pairs everywhere; on a CPU
    without AVX512_BF16 the former is refused by name."""
    torch.manual_seed(4)
    oracle = _experts(8, 64, 48, torch.bfloat16, bias=True)
    fused = _bound(oracle, kernels)
    weights, ids = _routing(33, 8, 3)
    x = torch.randn(33, 64).bfloat16()
    if path not in bf16_dot_paths():
        with pytest.raises(RuntimeError, match="not a path of this build"):
            fused_moe(kernels, fused.packed, x, weights, ids, bf16_dot=path)
        return
    got = fused_moe(kernels, fused.packed, x, weights, ids, bf16_dot=path)
    want = copy.deepcopy(oracle).float()(x.float(), weights, ids)
    assert (got.float() - want).abs().max() <= 2 ** -6 * want.abs().max()


def test_rejects_weights_packed_for_another_shape(kernels):
    fused = _bound(_experts(4, 32, 16, torch.float32), kernels)
    with pytest.raises(RuntimeError, match="not packed"):
        fused_moe(kernels, fused.packed, torch.randn(2, 64), torch.rand(2, 2),
                  torch.zeros(2, 2, dtype=torch.long))


@pytest.mark.slow
def test_other_lane_width_build(kernels, monkeypatch):
    """The vector width this CPU's build does not use (16 floats on AVX2, 8 on AVX-512): its
    tiles are another width, packed for it, and compute the same experts (bf16 products on
    the twin's own best path: the 8-wide build has no avx512_bf16 one)."""
    other = build_lane_twin(kernels)
    paths = list(other.bf16_dot_paths())
    monkeypatch.setattr(moe, "bf16_dot", lambda: "avx512_bf16" if "avx512_bf16" in paths else "fp32")
    assert other.fused_moe_tile() != kernels.fused_moe_tile()
    torch.manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        oracle = _experts(6, 30, 20, dtype, bias=True, activation=ACTIVATIONS["clamped_swiglu"])
        fused = _bound(oracle, other)
        for tokens in (1, 33):
            weights, ids = _routing(tokens, 6, 2, seed=tokens)
            _check(fused, oracle, torch.randn(tokens, 30).to(dtype), weights, ids)
    dense = _experts(6, 40, 20, torch.float32, bias=True)
    fp8, fused = _bound(_fp8_experts(dense, 16), other), _bound(dense, other)
    weights, ids = _routing(9, 6, 2)
    x = torch.randn(9, 40)
    assert torch.equal(fp8(x, weights, ids), fused(x, weights, ids))


def _fp8_experts(dense: FusedExperts, block: int) -> FusedExperts:
    """``dense`` quantized as a block-scaled fp8 checkpoint holds it, loaded into experts that
    keep it (gate and up quantized as separate tensors, as a checkpoint stores them); ``dense``
    gets the dequantized values, so the two compute the same experts."""
    fp8 = copy.deepcopy(dense)
    assert fp8.keep_fp8((block, block))
    inter = dense.intermediate_size
    with torch.no_grad():
        for e in range(dense.num_experts):
            for part in (0, 1):
                q, scale = quantize_blocks(dense.w13[e, part * inter:(part + 1) * inter].float(), block)
                fp8._load_w13(fp8.w13, q, (e, part))
                fp8._load_w13_scale(fp8.w13_scale_inv, scale, (e, part))
                dense.w13[e, part * inter:(part + 1) * inter] = dequantize(q, scale, (block, block))
            q, scale = quantize_blocks(dense.w2[e].float(), block)
            fp8._load_w2(fp8.w2, q, (e, 0))
            fp8._load_w2_scale(fp8.w2_scale_inv, scale, (e, 0))
            dense.w2[e] = dequantize(q, scale, (block, block))
    return fp8


@pytest.mark.parametrize("hidden,inter", [(64, 48), (30, 20), (160, 96)])
def test_fp8_experts_are_the_dequantized_experts(kernels, hidden, inter):
    """FP8 experts packed as loaded (one byte per weight and a scale per 16x16 tile; shapes
    with partial tiles and padding included) compute, with float32 activations, bitwise what
    the float32 kernel computes on the dequantized weights, and the torch path within
    rounding; with bfloat16 activations, within bf16 rounding of that."""
    torch.manual_seed(hidden)
    dense = _experts(6, hidden, inter, torch.float32, bias=True, activation=ACTIVATIONS["clamped_swiglu"])
    fp8 = _bound(_fp8_experts(dense, 16), kernels)
    assert fp8.packed.w13.dtype == torch.float8_e4m3fn and fp8.w13_scale_inv.is_meta
    fused = _bound(dense, kernels)
    # A byte per weight in the float32 packing's layout (its padding is the lane width's).
    assert fp8.packed.w13.numel() == fused.packed.w13.numel()
    for tokens in (1, 7, 40):
        weights, ids = _routing(tokens, 6, 2, seed=tokens)
        x = torch.randn(tokens, hidden)
        got = fp8(x, weights, ids)
        assert torch.equal(got, fused(x, weights, ids))
        torch.testing.assert_close(got, dense(x, weights, ids), atol=2e-5, rtol=1e-5)
        got16 = fp8(x.bfloat16(), weights, ids)
        want = dense(x.bfloat16().float(), weights, ids)
        assert got16.dtype == torch.bfloat16
        assert (got16.float() - want).abs().max() <= 2 ** -6 * want.abs().max()


def test_fp8_experts_another_path_reads_are_multiplied_out(kernels):
    """Where the fused kernel does not compute the experts (the torch path here), fp8 experts
    are multiplied out once at binding, to the model's dtype."""
    torch.manual_seed(6)
    dense = _experts(4, 32, 16, torch.bfloat16, activation=lambda g, u: g * u)
    fp8 = _fp8_experts(dense, 16)
    bind_platform(fp8, Platform("cpu", kernels))
    assert fp8.forward_path == "forward_native" and fp8.w13.dtype == torch.bfloat16
    assert not hasattr(fp8, "w13_scale_inv") and fp8.fp8_block is None
    assert torch.equal(fp8.w13, dense.w13) and torch.equal(fp8.w2, dense.w2)


def test_fp8_experts_keep_only_what_a_tile_grid_fits():
    """A tile that is no multiple of the kernel's half tile keeps dense weights (nothing
    changed; the tensor-parallel case: tests/distributed/test_tensor_parallel.py)."""
    experts = _experts(4, 32, 16, torch.float32)
    assert not experts.keep_fp8((12, 12)) and experts.w13.dtype == torch.float32


def _fp4_experts(dense: FusedExperts) -> FusedExperts:
    """``dense`` as an MXFP4 checkpoint holds it (DeepSeek-V4's release: gate, up and down as
    separate tensors), loaded into experts that keep the bytes; ``dense`` gets the values."""
    fp4 = copy.deepcopy(dense)
    assert fp4.keep_fp4()
    inter = dense.intermediate_size
    with torch.no_grad():
        for e in range(dense.num_experts):
            for part in (0, 1):
                q, scale = mxfp4(dense.w13[e, part * inter:(part + 1) * inter])
                fp4._load_w13(fp4.w13, q, (e, part))
                fp4._load_w13(fp4.w13_scale_inv, scale, (e, part))
                dense.w13[e, part * inter:(part + 1) * inter] = dequantize_fp4(q, scale)
            q, scale = mxfp4(dense.w2[e])
            fp4._load_w2_fp4(fp4.w2, q, (e, 0))
            fp4._load_w2_fp4(fp4.w2_scale_inv, scale, (e, 0))
            dense.w2[e] = dequantize_fp4(q, scale)
    return fp4


@pytest.mark.parametrize("build", ["this", "other lane width"])
def test_fp4_experts_are_the_dequantized_experts(kernels, build):
    """MXFP4 experts packed as loaded (half a byte per weight, a scale per 32 inputs of a
    row) compute, with float32 activations, bitwise what the float32 kernel computes on the
    dequantized weights (an intermediate size that pads to the tile included), on this CPU's
    build and on the other lane width's; bfloat16 activations within bf16 rounding."""
    ext = kernels if build == "this" else build_lane_twin(kernels)
    for hidden, inter in ((64, 32), (96, 160)):
        torch.manual_seed(hidden)
        dense = _experts(6, hidden, inter, torch.float32, bias=True, activation=ACTIVATIONS["clamped_swiglu"])
        fp4 = _bound(_fp4_experts(dense), ext)
        assert fp4.packed.w13.dtype == torch.uint8 and fp4.w13_scale_inv.is_meta
        assert fp4.packed.w13.numel() <= 0.5 * 1.25 * dense.w13.numel()  # half a byte per weight
        fused = _bound(dense, ext)
        for tokens in (1, 7, 40):
            weights, ids = _routing(tokens, 6, 2, seed=tokens)
            x = torch.randn(tokens, hidden)
            got = fp4(x, weights, ids)
            assert torch.equal(got, fused(x, weights, ids))
            torch.testing.assert_close(got, dense(x, weights, ids), atol=2e-5, rtol=1e-5)
            got16 = fp4(x.bfloat16(), weights, ids)
            want = dense(x.bfloat16().float(), weights, ids)
            assert (got16.float() - want).abs().max() <= 2 ** -6 * want.abs().max()


def test_fp4_experts_another_path_reads_are_multiplied_out(kernels):
    torch.manual_seed(7)
    dense = _experts(4, 64, 32, torch.bfloat16, activation=lambda g, u: g * u)
    fp4 = _fp4_experts(dense)
    bind_platform(fp4, Platform("cpu", kernels))
    assert fp4.forward_path == "forward_native" and fp4.w13.dtype == torch.bfloat16 and not fp4.fp4
    assert torch.equal(fp4.w13, dense.w13) and torch.equal(fp4.w2, dense.w2)
