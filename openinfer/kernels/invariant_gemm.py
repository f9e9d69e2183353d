"""Batch-invariant mode (``--batch-invariant``): a request's logits are bitwise the same whatever
else is in the step (other requests, decodes and prefills mixed, any batch size, however its own
prompt is cut into chunks).

    load_model ── load_weights ── make_batch_invariant(model)
                                    ├─ every GemmLayer gets an InvariantGemmPlan
                                    ├─ every Attention layer runs its backend's batch-invariant mode
                                    └─ every GatedMLP applies its activation in small row tiles

Where a CPU step's rows depend on each other, and what this mode does about it (measured on
x86 with MKL and oneDNN; ``tests/engine/test_batch_invariant.py`` checks the whole model):

* **GEMMs.** BLAS and oneDNN pick their kernels (and so the order of a row's reduction over K)
  by the row count M: F.linear gives row 0 three different values for M = 1, M = 2..3 and
  M >= 4, and a GEMM plan sends different M to different paths. Here one path is used for every
  M, and only for row counts whose results were checked at load: each row must come out the
  same whatever rows share the call and wherever it sits in it (a shuffled call, the first and
  last window of each size against the largest). A call of M rows runs as chunks of the largest
  checked size, then the rest padded with zeros to the next checked size. oneDNN on a prepacked
  weight passes for every power of two 1..128 here (5 rows run as 8, 300 as 128 + 128 + 64);
  F.linear for 4..128 (1..3 rows run as 4). Only row counts that were checked ever run, so a
  kernel that a larger M would pick never does. No path passing: one row per call (slow).
* **Attention.** The backends' invariant modes (``AttentionBackend.forward_batch_invariant``):
  the C++ kernel without split-KV and shared-prefix items and with one score path; the torch
  backend an online softmax over fixed key chunks in plain elementwise ops (SDPA's kernels depend
  on the padded length and on a chunk's row count).
* **Elementwise ops.** torch splits an op of >= 32768 elements across threads at arbitrary
  element offsets, and the elements before the next vector boundary take scalar code, whose exp
  rounds differently for silu. Row-local exact ops (add, mul, rsqrt, the norms' per-row
  reductions, rotary) are unaffected; silu runs in tiles under that size (one thread, all
  vector code).
* **Logits and sampling** are per row already (the LM head is a GEMM like the others; softmax,
  log_softmax, top-k/top-p, argmax work row by row; seeded rows draw from (seed, position)).

Cost (2-core AVX2 EPYC, fp32, the demo models): the GEMMs of a step of 1..32 rows cost what
the normal plan's do (oneDNN on a packed weight is what it picks for few rows anyway), of 256
rows ~10-15% more (128-row chunks); the C++ attention kernel's invariant mode costs 0-20% (more
with many threads: a lone long decode is no longer split across them); end to end 1.0-1.08x.
The torch backend's invariant attention is 5-50x slower than SDPA: a fallback, not a mode to
run. Load checks take ~0.1-1 s per distinct weight shape (cached per process).
"""

from __future__ import annotations

import bisect
import logging
import time

import torch
import torch.nn.functional as F

from openinfer.cpu_features import cpu_capability
from openinfer.kernels.gemm_paths import PACKED, PATHS, GemmPath, weight_formats
from openinfer.kernels.gemm_plan import BUCKETS, GemmPlan, Route, _mismatch
from openinfer.kernels.paged_attention import INVARIANT_GRAIN

logger = logging.getLogger(__name__)

CHUNK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
"""Row counts a batch-invariant GEMM may run, each checked at load; the largest is the chunk."""
PATH_PREFERENCE = ("onednn_packed", "torch", "onednn")
"""Paths tried in this order; the first whose checked sizes include 1 is taken, else the one
with the smallest checked size."""
ROW_BY_ROW = "torch"
"""The path run one row per call when no path passes its checks (each call then has one shape)."""
ALIGNMENT = 64
"""Bytes: inputs are aligned so (as checked at load; some BLAS kernels branch on alignment)."""

# (N, K, has bias, dtype, path, CPU capability, threads) -> checked sizes (None: path unusable)
_checked: dict[tuple, tuple[int, ...] | None] = {}


def clear_check_cache() -> None:
    _checked.clear()


class InvariantGemmPlan(GemmPlan):
    """y = x @ W^T + b with each row's result independent of the other rows of the call: one
    path, run on chunks of checked row counts only (see the module docstring)."""

    def __init__(self, path: GemmPath, weight: torch.Tensor, bias: torch.Tensor | None,
                 sizes: tuple[int, ...], extra_bytes: int, seconds: float) -> None:
        routes = [Route(b, path, weight, None, None) for b in BUCKETS]
        super().__init__(routes, bias, extra_bytes, seconds)
        self.invariant_sizes = sizes
        self._run = path.run
        self._weight = weight
        self._chunk = sizes[-1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        out = self._rows(flat)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self._out_features)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows == 0:
            return x.new_empty(0, self._out_features)
        if not x.is_contiguous() or x.data_ptr() % ALIGNMENT:
            x = torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x)
        run, weight, bias, chunk = self._run, self._weight, self.bias, self._chunk
        if rows <= chunk and rows == self.invariant_sizes[
                bisect.bisect_left(self.invariant_sizes, rows)]:
            return run(x, weight, bias)  # a checked size: as it is
        pieces = []
        full = rows - rows % chunk
        for start in range(0, full, chunk):
            piece = x[start:start + chunk]
            if piece.data_ptr() % ALIGNMENT:  # only for chunks of a few rows (row by row)
                piece = piece.clone()
            pieces.append(run(piece, weight, bias))
        if full < rows:
            rest = rows - full
            size = self.invariant_sizes[bisect.bisect_left(self.invariant_sizes, rest)]
            padded = x.new_zeros(size, x.shape[1])
            padded[:rest] = x[full:]
            pieces.append(run(padded, weight, bias)[:rest])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def plan_invariant_gemm(weight: torch.Tensor, bias: torch.Tensor | None,
                        shared: bool = False) -> InvariantGemmPlan:
    """The weight's batch-invariant plan: the first path of PATH_PREFERENCE whose checks pass
    down to 1 row, else the one with the smallest checked size, else row by row. A plan on a
    packed weight reads no plain one (``reads_plain``): the caller may free it unless
    ``shared``."""
    start = time.perf_counter()
    weight_in = weight_formats(weight)

    best: tuple[str, tuple[int, ...]] | None = None
    for name in PATH_PREFERENCE:
        sizes = checked_sizes(PATHS[name], weight, bias, weight_in)
        if sizes is not None and (best is None or sizes[0] < best[1][0]):
            best = (name, sizes)
        if best is not None and best[1][0] == 1:
            break
    if best is None:
        logger.warning("batch-invariant GEMM %s %s: no path passed its checks; running one row "
                       "per call (slow)", tuple(weight.shape), weight.dtype)
        best = (ROW_BY_ROW, (1,))
    path = PATHS[best[0]]
    w = weight_in(path.weight_format)
    extra = 0
    if path.weight_format == PACKED and shared:
        extra = weight.numel() * weight.element_size()
    return InvariantGemmPlan(path, w, bias, best[1], extra, time.perf_counter() - start)


def checked_sizes(path: GemmPath, weight: torch.Tensor, bias: torch.Tensor | None,
                  weight_in) -> tuple[int, ...] | None:
    """The row counts of CHUNK_SIZES at which ``path`` gives every row the result it gets in a
    shuffled call of the largest size (itself checked against F.linear); None if the path
    cannot run here, is wrong, or depends on a row's place in the largest call. Cached per
    shape, dtype, path, CPU and thread count."""
    key = (*weight.shape, bias is not None, weight.dtype, path.name, cpu_capability(),
           torch.get_num_threads())
    if key not in _checked:
        _checked[key] = _check_sizes(path, weight, bias, weight_in)
    return _checked[key]


def _check_sizes(path: GemmPath, weight: torch.Tensor, bias: torch.Tensor | None,
                 weight_in) -> tuple[int, ...] | None:
    chunk = CHUNK_SIZES[-1]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(chunk, weight.shape[1], generator=g).to(weight.dtype)
    try:
        w = weight_in(path.weight_format)
        y = path.run(x, w, bias)
    except RuntimeError as e:
        logger.debug("batch-invariant GEMM: %s cannot run %s %s: %s", path.name,
                     tuple(weight.shape), weight.dtype, str(e).splitlines()[0])
        return None
    problem = _mismatch(y, F.linear(x, weight, bias))
    if problem is not None:
        logger.warning("batch-invariant GEMM: %s left out for %s %s: %s", path.name,
                       tuple(weight.shape), weight.dtype, problem)
        return None
    perm = torch.randperm(chunk, generator=g)
    if not torch.equal(path.run(x[perm].contiguous(), w, bias), y[perm]):
        logger.debug("batch-invariant GEMM: %s depends on a row's place in a %d-row call",
                     path.name, chunk)
        return None
    sizes = [s for s in CHUNK_SIZES[:-1]
             if all(torch.equal(path.run(x[j * s:(j + 1) * s].clone(), w, bias),
                                y[j * s:(j + 1) * s]) for j in (0, chunk // s - 1))]
    return (*sizes, chunk)


def invariant_silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in row tiles of fewer than INVARIANT_GRAIN elements: each runs on one
    thread, every row through the same vector code (see the module docstring)."""
    rows, width = gate.shape[0], gate.shape[-1]
    tile = max(1, (INVARIANT_GRAIN - 1) // width)
    if rows <= tile:
        return F.silu(gate) * up
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    for r0 in range(0, rows, tile):
        torch.mul(F.silu(gate[r0:r0 + tile]), up[r0:r0 + tile], out=out[r0:r0 + tile])
    return out
