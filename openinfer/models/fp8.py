"""Block-quantized FP8 checkpoints (DeepSeek-V3/R1's and Qwen3-FP8's format).

Such a checkpoint stores most linear weights as ``float8_e4m3fn`` and, beside each, a
``<name>_scale_inv`` float32 tensor with one scale per ``weight_block_size`` (128 x 128) tile:
``W[i, j] = fp8[i, j] * scale_inv[i // 128, j // 128]`` (the scales may be float8_e8m0fnu
powers of two, ``"scale_fmt": "ue8m0"``, as DeepSeek-V3.1 and V4 store them: read as float32).
config.json says so:
``"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], ...}``.

A linear layer's weight is kept as loaded, one byte per weight (``GemmLayer.keep_fp8``;
its GEMMs read it through openinfer.kernels.fp8_gemm); every other fp8 tensor (stacked
experts, a layer that cannot keep it) is multiplied out once while loading.
``OPENINFER_FP8_WEIGHTS=dequantize`` multiplies out every one (the model then holds bf16/fp32
weights, as before fp8 layers existed). Any other ``quant_method`` is refused by name:
loading its packed integers as if they were weights would serve garbage.

DeepSeek-V4's release adds two things (transformers reads the same): a scale may be named
``<module>.scale`` instead of ``<module>.weight_scale_inv`` (read as the latter), and with
``"expert_dtype": "fp4"`` the routed experts are MXFP4: ``int8`` [N, K / 2], two e2m1 values
per byte (the low nibble first), and one power-of-two scale per 32 inputs of a row
([N, K / 32], float8_e8m0fnu). The fused CPU MoE kernel reads those as loaded
(``FusedExperts.keep_fp4``); where it does not run they are multiplied out.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import torch

from openinfer.kernels.fp8_gemm import dequantize, dequantize_fp4

SCALE_SUFFIX = "_scale_inv"
RELEASE_SCALE_SUFFIX = ".scale"
"""DeepSeek-V4's name for a weight's scales: ``<module>.scale`` for ``<module>.weight_scale_inv``."""
FP8_WEIGHTS_ENV = "OPENINFER_FP8_WEIGHTS"
EXPERT_DTYPES = ("fp8", "fp4")


def block_size_of(hf: dict) -> tuple[int, int] | None:
    """The checkpoint's FP8 tile, or None when it is not quantized. Raises for a
    quantization openinfer cannot load."""
    quant = hf.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    if method != "fp8" or not quant.get("weight_block_size"):
        raise ValueError(f"quantization_config: quant_method {method!r} "
                         f"{'(without weight_block_size) ' if method == 'fp8' else ''}is not "
                         "supported; block-quantized fp8 (DeepSeek-V3's format) is")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config: fp8 format {fmt!r} is not supported (e4m3 is)")
    if quant.get("expert_dtype", "fp8") not in EXPERT_DTYPES:
        raise ValueError(f"quantization_config: expert_dtype {quant['expert_dtype']!r} is not "
                         f"supported ({' or '.join(EXPERT_DTYPES)} is)")
    rows, cols = quant["weight_block_size"]
    return int(rows), int(cols)


def keeps_fp8() -> bool:
    """Whether linear layers hold fp8 weights as loaded (``OPENINFER_FP8_WEIGHTS``)."""
    mode = os.environ.get(FP8_WEIGHTS_ENV, "keep")
    if mode not in ("keep", "dequantize"):
        raise ValueError(f"{FP8_WEIGHTS_ENV}={mode!r}: keep or dequantize")
    return mode == "keep"


def fp4_experts(hf: dict) -> bool:
    """Whether the checkpoint's routed experts are MXFP4 (``expert_dtype: fp4``)."""
    return (hf.get("quantization_config") or {}).get("expert_dtype") == "fp4"


def canonical_name(name: str) -> str:
    """A tensor's name with DeepSeek-V4's ``<module>.scale`` read as ``<module>.weight_scale_inv``."""
    if name.endswith(RELEASE_SCALE_SUFFIX):
        return name.removesuffix(RELEASE_SCALE_SUFFIX) + ".weight" + SCALE_SUFFIX
    return name


def _dequantize_any(weight: torch.Tensor, scale: torch.Tensor,
                    block: tuple[int, int]) -> torch.Tensor:
    if weight.dtype in (torch.int8, torch.uint8):  # MXFP4: fp8 weights are float8_e4m3fn
        return dequantize_fp4(weight, scale)
    rows = weight.shape[0]
    if scale.shape[0] == rows != -(-rows // block[0]):
        # A scale per row and ``block[1]`` inputs (V4.1's Engram tables: 1 x 32 blocks).
        return dequantize(weight, scale, (1, block[1]))
    return dequantize(weight, scale, block)


def dequantizing(tensors: Iterator[tuple[str, torch.Tensor]], block: tuple[int, int],
                 kept: Callable[[str], bool] = lambda name: False,
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each fp8 weight multiplied out by its scales (which may
    come before or after it, from any shard) and the scale tensors consumed, except the
    weights ``kept`` names: those and their scales pass as they are."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if kept(name.removesuffix(SCALE_SUFFIX)):
            yield name, tensor
        elif name.endswith(SCALE_SUFFIX):
            target = name.removesuffix(SCALE_SUFFIX)
            if target in weights:
                yield target, _dequantize_any(weights.pop(target), tensor, block)
            else:
                scales[target] = tensor
        elif tensor.dtype == torch.float8_e4m3fn or (
                tensor.dtype in (torch.int8, torch.uint8) and name.endswith(".weight")):
            if name in scales:
                yield name, _dequantize_any(tensor, scales.pop(name), block)
            else:
                weights[name] = tensor
        else:
            yield name, tensor
    if weights or scales:
        lonely = sorted(weights)[:3] + sorted(n + SCALE_SUFFIX for n in scales)[:3]
        raise ValueError(f"fp8 checkpoint: weights and scales do not pair up, e.g. {lonely}")
