"""The C++ elementwise kernels against torch: RMSNorm (with the residual add fused; float32
within rounding, bfloat16 within a rare step), rotary embedding (bitwise), the gated MLP's
SiLU-and-multiply and the K/V cache write; and the engine using them on the cpu attention
backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from openinfer.kernels.custom_op import Platform
from openinfer.layers.mlp import GatedMLP
from openinfer.layers.norm import RMSNorm
from openinfer.layers.rotary import RotaryEmbedding
from openinfer.models.platform import bind_platform


def _norms(kernels, hidden: int, dtype: torch.dtype = torch.float32) -> tuple[RMSNorm, RMSNorm]:
    plain, fused = RMSNorm(hidden, eps=1e-5).to(dtype), RMSNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        plain.weight.normal_()
        fused.weight.copy_(plain.weight)
    bind_platform(fused, Platform("cpu", kernels))
    return plain, fused


@pytest.mark.parametrize("shape", [(1, 1024), (32, 1024), (300, 896), (7, 5)])
def test_matches_torch_with_and_without_the_residual(kernels, shape):
    torch.manual_seed(0)
    plain, fused = _norms(kernels, shape[-1])
    x, residual = torch.randn(shape), torch.randn(shape)
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-5, atol=1e-5)
    out, total = fused(x, residual)
    ref_out, ref_total = plain(x, residual)
    assert torch.equal(total, ref_total)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 1024), (32, 1024), (300, 896), (7, 5), (3, 37)])
def test_bfloat16_rounds_as_torch_does(kernels, shape):
    """bf16 rows, weight and residual: the kernel rounds where the torch composite does (the
    sum, the normalised row, the product), vector body and scalar tail. The sum is bitwise
    torch's; the outputs too, but for the rare value whose float32 lies so near a bf16
    rounding boundary that the sum of squares' order (8 partial sums here, torch's own
    elsewhere) moves it across: one bf16 step at most."""
    torch.manual_seed(3)
    plain, fused = _norms(kernels, shape[-1], torch.bfloat16)
    x, residual = torch.randn(shape).bfloat16() * 3, torch.randn(shape).bfloat16()
    if shape[-1] > 5:
        x[0, 0] = float("nan")
    (out, total), (want_out, want_total) = fused(x, residual), plain(x, residual)
    assert torch.equal(total.nan_to_num(), want_total.nan_to_num())
    for got, want in ((fused(x), plain(x)), (out, want_out)):
        assert torch.equal(got.isnan(), want.isnan())
        got, want = got.nan_to_num().float(), want.nan_to_num().float()
        assert (got != want).float().mean() < 0.01
        torch.testing.assert_close(got, want, rtol=2**-6, atol=0)  # a step, then a rounding


def test_a_float32_weight_on_bfloat16_rows_stays_on_torch(kernels):
    """DeepSeek-V4's norms keep float32 weights and round once at the end: not the kernel's
    rounding, so those calls take the torch path."""
    norm = RMSNorm(64, fp32_weight=True)
    bind_platform(norm, Platform("cpu", kernels))
    x = torch.randn(4, 64).bfloat16()
    want = (norm.weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True)
                                                   + norm.eps))).bfloat16()
    assert torch.equal(norm(x), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 3072), (33, 768), (5, 37), (0, 64)])
def test_silu_and_mul_matches_torch(kernels, dtype, rows, inter):
    """float32 within the exp's rounding; bfloat16 bitwise (silu rounded, then the product),
    also on a tail shorter than a vector."""
    torch.manual_seed(4)
    x = (torch.randn(rows, 2 * inter) * 6).to(dtype)
    out = torch.empty(rows, inter, dtype=dtype)
    kernels.silu_and_mul(out, x)
    gate, up = x.split(inter, dim=-1)
    want = F.silu(gate) * up
    if dtype == torch.bfloat16:
        assert torch.equal(out, want)
    else:
        torch.testing.assert_close(out, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gated_mlp_uses_the_kernel_where_it_applies(kernels, dtype):
    torch.manual_seed(5)
    plain = GatedMLP(64, 96).to(dtype)
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_(std=0.2)
    fused = GatedMLP(64, 96).to(dtype)
    fused.load_state_dict(plain.state_dict())
    bind_platform(fused, Platform("cpu", kernels))
    calls = []
    real = kernels.silu_and_mul

    class Counting:  # the extension module's attributes are read-only: wrap it
        def __getattr__(self, name):
            return getattr(kernels, name)

        def silu_and_mul(self, out, x):
            calls.append(tuple(x.shape))
            return real(out, x)

    bind_platform(fused, Platform("cpu", Counting()))
    x = torch.randn(7, 64).to(dtype)
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-5 if dtype == torch.float32 else 0,
                               atol=1e-5 if dtype == torch.float32 else 0)
    assert calls == [(7, 192)]
    clamped = GatedMLP(64, 96, clamp_limit=0.5).to(dtype)  # DeepSeek-V4: torch's path
    bind_platform(clamped, Platform("cpu", fused.cpu_kernels))
    clamped(x)
    assert calls == [(7, 192)]


def _rope(rotary_dim: int = 64, interleaved: bool = False) -> RotaryEmbedding:
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    return RotaryEmbedding(64, rotary_dim, 4096, inv_freq, attention_factor=1.1,
                           interleaved=interleaved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_rotary_is_bitwise_torchs(kernels, dtype, tokens):
    """q and k as views into a fused q/k/v output (rows strided by its width), and
    contiguous (after q/k norms): the kernel's bits are torch's, with no fused multiply-add."""
    torch.manual_seed(6)
    qkv = (torch.randn(tokens, 16 * 64 + 2 * 4 * 64) * 5).to(dtype)
    q, k = qkv[:, :1024].view(tokens, 16, 64), qkv[:, 1024:1280].view(tokens, 4, 64)
    positions = torch.randint(0, 4096, (tokens,))
    plain, fast = _rope(), _rope()
    bind_platform(fast, Platform("cpu", kernels))
    for qi, ki in ((q, k), (q.contiguous(), k.contiguous())):
        for got, want in zip(fast(positions, qi, ki), plain(positions, qi, ki)):
            assert got.is_contiguous() and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 300])
def test_qk_norm_and_rotary_in_one_pass_give_the_bits_of_the_two_steps(kernels, dtype, tokens):
    """Qwen3's q/k norms passed to the rotary: the kernel normalises and rotates each head row
    in one pass, bitwise what the C++ norms and then the rotation give, and what torch's
    path gives for the rotation of torch-normalised rows (bf16 norms: within a rare step)."""
    torch.manual_seed(8)
    qkv = (torch.randn(tokens, 16 * 64 + 2 * 4 * 64) * 5).to(dtype)
    q, k = qkv[:, :1024].view(tokens, 16, 64), qkv[:, 1024:1280].view(tokens, 4, 64)
    positions = torch.randint(0, 4096, (tokens,))
    q_plain, q_norm = _norms(kernels, 64, dtype)
    k_plain, k_norm = _norms(kernels, 64, dtype)
    plain, fast = _rope(), _rope()
    bind_platform(fast, Platform("cpu", kernels))
    calls = []
    real = kernels.rms_norm
    recording = Platform("cpu", _Recording(kernels, calls))
    bind_platform(q_norm, recording)
    bind_platform(k_norm, recording)
    fused = fast(positions, q, k, q_norm, k_norm)
    assert calls == []  # the norms ran inside the rotary kernel
    two_steps = fast(positions, _kernel_norm(real, q, q_norm), _kernel_norm(real, k, k_norm))
    for got, want in zip(fused, two_steps):
        assert torch.equal(got, want)
    for got, want in zip(fused, plain(positions, q_plain(q), k_plain(k))):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert (got != want).float().mean() < 0.01
    # Norms the kernel cannot take (a float32 weight on bf16 rows, different eps) run first.
    k_norm.eps = 1e-3
    for got, want in zip(fast(positions, q, k, q_norm, k_norm),
                         fast(positions, q_norm(q), k_norm(k))):
        assert torch.equal(got, want)


class _Recording:
    """The extension, recording calls of its standalone norm."""

    def __init__(self, kernels, calls: list) -> None:
        self._kernels, self._calls = kernels, calls

    def rms_norm(self, *args) -> None:
        self._calls.append(args[1].shape)
        self._kernels.rms_norm(*args)

    def __getattr__(self, name: str):
        return getattr(self._kernels, name)


def _kernel_norm(rms_norm, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype)
    rms_norm(out, x, norm.weight, norm.eps)
    return out


def test_rotary_variants_the_kernel_does_not_cover_stay_on_torch(kernels):
    torch.manual_seed(7)
    q, k = torch.randn(3, 2, 64), torch.randn(3, 1, 64)
    positions = torch.tensor([0, 7, 4095])
    for make in (lambda: _rope(rotary_dim=32), lambda: _rope(interleaved=True)):
        plain, fast = make(), make()
        bind_platform(fast, Platform("cpu", object()))  # poisoned: only torch's path succeeds
        for got, want in zip(fast(positions, q, k), plain(positions, q, k)):
            assert torch.equal(got, want)
    fast = _rope()
    bind_platform(fast, Platform("cpu", kernels))
    with pytest.raises(RuntimeError, match="a position past the cache"):
        fast(torch.tensor([4096, 0, 1]), q, k)


def test_per_head_norm_reads_a_view_of_the_fused_qkv_output(kernels):
    torch.manual_seed(1)
    plain, fused = _norms(kernels, 64)
    qkv = torch.randn(9, 16 * 64 + 2 * 8 * 64)
    q = qkv[:, :16 * 64].view(9, 16, 64)        # rows strided by the qkv width
    k = qkv[:, 16 * 64:24 * 64].view(9, 8, 64)
    for view in (q, k):
        assert not view.is_contiguous()
        torch.testing.assert_close(fused(view), plain(view), rtol=1e-5, atol=1e-5)
    transposed = torch.randn(64, 9).t()          # unit stride missing: torch's path
    torch.testing.assert_close(fused(transposed), plain(transposed))


def test_a_row_is_normalized_the_same_in_any_batch(kernels):
    """One thread reduces a row in a fixed order: bitwise the same alone or among others."""
    torch.manual_seed(2)
    _, fused = _norms(kernels, 1024)
    rows = torch.randn(257, 1024)
    batched = fused(rows)
    for i in (0, 100, 256):
        assert torch.equal(fused(rows[i:i + 1].clone()), batched[i:i + 1])


def test_float32_engines_on_the_cpu_backend_use_it(qwen3_checkpoint, kernels):
    from openinfer import LLM

    llm = LLM(str(qwen3_checkpoint), progress=False, attention_backend="cpu",
              kv_cache_memory=16 * 2**20)
    model = llm.engine.core.executor.worker.model
    norms = [m for m in model.modules() if isinstance(m, (RMSNorm, GatedMLP, RotaryEmbedding))]
    assert len({type(m) for m in norms}) == 3
    assert all(m.cpu_kernels is kernels and m.forward_path == "forward_cpu" for m in norms)
    reference = LLM(str(qwen3_checkpoint), progress=False, attention_backend="torch",
                    kv_cache_memory=16 * 2**20)
    assert all(m.cpu_kernels is None and m.forward_path == "forward_native"
               for m in reference.engine.core.executor.worker.model.modules()
               if isinstance(m, (RMSNorm, GatedMLP, RotaryEmbedding)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 37, 600])
def test_write_kv_stores_what_torch_stores(kernels, dtype, tokens):
    """The step's K/V into their slots, as the engine lays them out: each layer's cache a
    strided view of blocks that hold every layer, K and V views into the fused q/k/v output;
    slots in any order, across blocks. Equal to the torch write, and only those slots change."""
    from openinfer.attention.cpu import write_kv
    from openinfer.kernels.paged_attention import write_kv as torch_write_kv

    torch.manual_seed(0)
    num_blocks, block_size, heads, head_dim, layers = 64, 16, 4, 32, 3
    blocks = torch.randn(num_blocks, layers, 2, block_size, heads, head_dim).to(dtype)
    cache = blocks[:, 1].transpose(0, 1)  # [2, num_blocks, block_size, heads, head_dim]
    qkv = torch.randn(tokens, (2 + 2 * heads) * head_dim).to(dtype)
    k = qkv[:, 2 * head_dim:(2 + heads) * head_dim].view(tokens, heads, head_dim)
    v = qkv[:, (2 + heads) * head_dim:].view(tokens, heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    expected = blocks.clone()
    torch_write_kv(expected[:, 1].transpose(0, 1), k, v, slots)
    write_kv(cache, k, v, slots)
    assert torch.equal(blocks, expected)  # (a write that did nothing leaves the old values)


def test_write_kv_refuses_a_slot_out_of_range(kernels):
    cache = torch.zeros(2, 4, 16, 2, 16)
    k = v = torch.ones(1, 2, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.write_kv(cache, k, v, torch.tensor([4 * 16]))
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.write_kv(cache, k, v, torch.tensor([-1]))
    assert not cache.any()
