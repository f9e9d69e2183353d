"""float8 KV caches (``--kv-cache-dtype``, vLLM's flag): the dtypes, and the torch reference of
how a key or value is stored and read back.

A layer's K (and V) carry one float32 scale each (per tensor, vLLM's ``k_scale``/``v_scale``):
a value ``x`` is stored as ``float8(clamp(x * (1 / scale), -max, max))``, rounded to nearest
even, and read back as ``stored * scale``. The clamp keeps an outlier finite (e4m3fn has no
infinity: a plain conversion would make it NaN). Scales come from the checkpoint where it has
them (``self_attn.k_scale``/``v_scale``, as llm-compressor writes them), else 1.0 (vLLM's
default): e4m3 then holds magnitudes up to 448 with 3 mantissa bits, e5m2 up to 57344 with 2.

Attention always reads K/V back from the cache (a prompt's own chunk included), so a token's
result depends on the stored values only: a prefix hit, a tier reload or a KV transfer gives
the tokens a cold prefill gives. The kernels (CPU ``paged_attention``/``write_kv``, Triton) fold
the scales into the softmax scale and the output rows instead of multiplying every element.
"""

from __future__ import annotations

import torch

from openinfer.config import KV_CACHE_DTYPES

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP8_NAMED = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for ``--kv-cache-dtype name`` (config.KV_CACHE_DTYPES)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return _FP8_NAMED.get(name, model_dtype)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache stores it: the same values in ``dtype``, or for a float8 cache
    ``float8(clamp(x * (1 / scale)))`` (the C++ ``write_kv`` computes exactly this)."""
    if not is_fp8(dtype):
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return (x.float() * inverse_scale(scale)).clamp_(-limit, limit).to(dtype)


def inverse_scale(scale: float) -> float:
    """1 / scale rounded to float32: what every write multiplies a value by (the C++ and Triton
    writes compute it so too)."""
    return torch.tensor(1.0 / scale, dtype=torch.float32).item()


def dequantize_kv(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache entries as the attention reads them, in ``dtype`` (a float8 entry times its scale)."""
    if not is_fp8(stored.dtype):
        return stored.to(dtype)
    return (stored.float() * scale).to(dtype)
