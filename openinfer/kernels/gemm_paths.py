"""The paths a CPU GEMM plan (openinfer/kernels/gemm_plan.py) chooses between: each computes
y = x @ W^T + b from the weight in one of four formats.

    path           weight           call
    torch          plain [N, K]     F.linear(x, W, b): the reference every path is checked against
    torch_t        plain            (W @ x^T)^T made contiguous (MKL runs 2..256 rows faster so on
                                    AVX2; openinfer's rule before plans, see layers/linear.py)
    onednn         plain            oneDNN matmul, mkldnn._linear_pointwise(x, W, b)
    onednn_packed  packed           the same on W reordered once, at load, into the blocked layout
                                    oneDNN's kernels read (for bf16: what VDPBF16PS/AMX read).
                                    vLLM's CPU linears do this.
    small_gemm     plain            openinfer's C++ few-row kernel (kernels/cpu/small_gemm.cpp):
                                    streams W once at close to the read bandwidth; float32, and
                                    bfloat16 widened in registers; timed for up to 128 rows
    widened        plain            F.linear in float32 on a bfloat16/float16 weight widened for
                                    the call (MKL's sgemm): prefill on CPUs with no 16-bit GEMM
                                    instructions, where ATen converts element by element (3x
                                    slower than float32 at 512 rows, 2 Zen 3 cores); the
                                    weight stays 16-bit in memory. Timed from 17 rows
    amx            amx              openinfer's AMX kernel (kernels/cpu/amx_gemm.cpp) on W packed
                                    once into 1 KiB tile blocks in the order they are read; bf16
                                    on CPUs with AMX. 1.4-1.7x oneDNN's packed linear at 1-4
                                    rows, 1.8-2.5x at 17-32, parity at 512 (2 Intel cores)
    mkl_packed     mkl              MKL's sgemm on W packed once, at load, by cblas_sgemm_pack
                                    (kernels/cpu/mkl_gemm.cpp); float32. F.linear's sgemm repacks
                                    W on every call: packed once, 1.1x F.linear at 512 rows and
                                    up to 2x at a few rows (2 Intel cores)

A layer keeps its weight in the formats its chosen paths read (``weight_formats`` makes each
packed copy once); the plan decides which.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from openinfer.kernels.cpu_attention import load_cpu_attention


@dataclass(frozen=True)
class Bucket:
    min_rows: int
    max_rows: int | None
    """None: no upper bound."""
    timed_rows: int
    build_margin: float = 1.0
    """Paths that build a kernel per row count must be this much faster here (BUILD_MARGIN)."""

    def __str__(self) -> str:
        if self.max_rows is None:
            return f"M>{self.min_rows - 1}"
        if self.min_rows == self.max_rows:
            return f"M={self.min_rows}"
        return f"M={self.min_rows}-{self.max_rows}"



PLAIN, PACKED, AMX, MKL = "plain", "packed", "amx", "mkl"
FORMATS = (PLAIN, PACKED, AMX, MKL)
PACK_ROWS = 128
"""The row count oneDNN picks the packed layout for (vLLM packs for 128 too)."""
MKL_PACK_ROWS = 512
"""The row count MKL picks its packed layout for: packed for 512, a 6144x1024 weight ran 1..512
rows at the speed of packed-for-that-count (packed for 16, 512 rows ran 1.4x slower)."""


def _torch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, b)


def _torch_t(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = torch.mm(w, x.t()).t().contiguous()
    return out if b is None else out.add_(b)


def _onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _small_gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    kernels = load_cpu_attention()
    if kernels is None:
        raise RuntimeError("the CPU kernel extension cannot be built here")
    if x.dtype != w.dtype or w.dtype not in (torch.float32, torch.bfloat16):
        raise RuntimeError("small_gemm runs float32 and bfloat16 only")
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    kernels.small_gemm(out, x.contiguous(), w, b)
    return out


def _widened(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    if w.dtype not in (torch.bfloat16, torch.float16):
        raise RuntimeError("widened is for bfloat16 and float16 weights")
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def _amx(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return _amx_kernels().amx_gemm(x, w, b)  # (allocates its output: no Python torch.empty)


def _mkl(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return _mkl_kernels().mkl_gemm(x, w, b)


def _kernels_with(available: str, missing: str):
    """The CPU extension, if its ``available()`` check passes; else RuntimeError(missing)."""
    kernels = load_cpu_attention()
    if kernels is None or not getattr(kernels, available)():
        raise RuntimeError(missing)
    return kernels


@functools.cache  # the hot path: once found, the module; a refusal raises (and is not kept)
def _mkl_kernels():
    return _kernels_with("mkl_gemm_available",
                         "no MKL packed GEMM here (torch built without MKL, or no kernel build)")


def mkl_pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """float32 ``weight`` [N, K] packed by MKL (cblas_sgemm_pack), in a uint8 tensor of N rows
    (so that its ``shape[0]`` is still the output size). MKL asks for more bytes than it writes
    (a 1024x1024 weight: 13.3 MiB asked, 5.3 written); the tail is never touched, so it takes
    no memory. Raises RuntimeError without MKL or for other dtypes."""
    if weight.dtype != torch.float32:
        raise RuntimeError("the MKL packed GEMM is float32 only")
    kernels = _mkl_kernels()
    n, k = weight.shape
    size = kernels.mkl_packed_bytes(n, k, MKL_PACK_ROWS)
    packed = torch.empty(n, -(-size // n), dtype=torch.uint8)
    kernels.mkl_pack_weight(packed, weight.contiguous(), MKL_PACK_ROWS)
    return packed


@functools.cache
def _amx_kernels():
    return _kernels_with("amx_gemm_available",
                         "no AMX GEMM here (a CPU or build without AMX-BF16, or tile state refused)")


def amx_pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] in the amx path's tile blocks ([N, K/32, 32], the same bytes). Raises
    RuntimeError where there is no AMX, for other dtypes, or unless 16 | N and 32 | K."""
    return _amx_kernels().amx_pack_weight(weight)


@dataclass(frozen=True)
class GemmPath:
    name: str
    weight_format: str
    """PLAIN (the loaded [N, K] tensor), PACKED (see ``pack_weight``), AMX (``amx_pack_weight``)
    or MKL (``mkl_pack_weight``)."""
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    """(x [M, K], weight in ``weight_format``, bias or None) -> [M, N]."""
    rows: tuple[int, int | None] = (1, None)
    """The buckets it is timed in lie within these rows (it runs correctly for any M)."""
    builds_per_rows: frozenset[torch.dtype] = frozenset()
    """Dtypes for which the call builds a kernel per row count on first sight of it (oneDNN
    creates a primitive: 4-5 ms per new M and weight shape): prefill-sized calls are padded to
    a multiple of PAD_ROWS rows, so that new prompt lengths reuse a bucket's primitive."""

    def timed_in(self, bucket: Bucket) -> bool:
        low, high = self.rows
        return bucket.min_rows >= low and (high is None or (bucket.max_rows is not None
                                                            and bucket.max_rows <= high))


_ONEDNN_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
"""What oneDNN runs. F.linear goes to oneDNN for bf16 and fp16; its float32 calls go to MKL's
sgemm, which builds nothing per row count."""

PATHS: dict[str, GemmPath] = {p.name: p for p in (
    GemmPath("torch", PLAIN, _torch, builds_per_rows=frozenset({torch.bfloat16, torch.float16})),
    GemmPath("torch_t", PLAIN, _torch_t, rows=(2, 256)),
    GemmPath("onednn", PLAIN, _onednn, builds_per_rows=_ONEDNN_DTYPES),
    GemmPath("onednn_packed", PACKED, _onednn, builds_per_rows=_ONEDNN_DTYPES),
    GemmPath("small_gemm", PLAIN, _small_gemm, rows=(1, 128)),
    GemmPath("widened", PLAIN, _widened, rows=(17, None)),
    GemmPath("amx", AMX, _amx),
    GemmPath("mkl_packed", MKL, _mkl),
)}


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` reordered by oneDNN for its matmul kernels (an opaque mkldnn tensor).
    Raises RuntimeError where oneDNN has no kernel for its dtype on this CPU."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS)


def weight_formats(weight: torch.Tensor) -> Callable[[str], torch.Tensor]:
    """``weight`` in a format (one of FORMATS); each packed copy is made when first asked."""
    packed: dict[str, torch.Tensor] = {}
    packers = {PACKED: pack_weight, AMX: amx_pack_weight, MKL: mkl_pack_weight}

    def weight_in(fmt: str) -> torch.Tensor:
        if fmt == PLAIN:
            return weight
        if fmt not in packed:
            packed[fmt] = packers[fmt](weight)
        return packed[fmt]

    return weight_in
