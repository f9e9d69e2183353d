"""The C++ float32 RMSNorm (with the residual add fused) against torch's, and the engine
using it on the cpu attention backend."""

from __future__ import annotations

import pytest
import torch

from openinfer.kernels.cpu_attention import load_cpu_attention
from openinfer.layers.norm import RMSNorm, use_cpu_kernels


@pytest.fixture(scope="module")
def kernels():
    ext = load_cpu_attention()
    if ext is None:
        pytest.skip("the CPU kernel extension cannot be built here")
    return ext


def _norms(kernels, hidden: int) -> tuple[RMSNorm, RMSNorm]:
    plain, fused = RMSNorm(hidden, eps=1e-5), RMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        plain.weight.normal_()
        fused.weight.copy_(plain.weight)
    use_cpu_kernels(fused, kernels)
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
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.cpu_kernels is kernels for m in norms)
    reference = LLM(str(qwen3_checkpoint), progress=False, attention_backend="torch",
                    kv_cache_memory=16 * 2**20)
    assert all(m.cpu_kernels is None for m in reference.engine.core.executor.worker.model.modules()
               if isinstance(m, RMSNorm))
