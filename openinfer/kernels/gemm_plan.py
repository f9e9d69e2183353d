"""CPU GEMM plans: y = x @ W^T + b by the fastest correct path for this CPU, chosen at load.

    load_model ── load_weights ── process_weights_after_loading ── plan_gemms(model)
                                  ──> every GemmLayer (Linear, MergedLinear, LMHead) gets the
                                      GemmPlan ``plan_weight`` makes for its weight

``plan_gemms`` (openinfer/models/gemm_plans.py) walks the model; this module knows weights, not
layers. The paths, and the weight formats they read, are in openinfer/kernels/gemm_paths.py.

A plan sends each call, by its row count M (tokens in the step), to one path:

    bucket (rows)   1  |  2..16  |  17..128  |  129..1024  |  1025..
    timed at M      1  |    8    |     32    |     512     |   512 (the same timing)

The LM head times only the first three buckets (logits are computed for each sampling
sequence's last token, so it sees at most max_num_seqs rows); its last bucket takes the last
timed bucket's path, or ``torch`` where that path is not made for so many rows.

Choosing, for each distinct (N, K, bias, dtype) on this CPU and thread count; timings are
cached for the process, so a model's 30 identical layers are timed once:
  1. each path runs once per bucket on random rows and must match F.linear (fp32: 1e-4, bf16:
     2e-2, relative to the output's largest value); a path that raises (oneDNN has no bf16
     kernels without AVX-512 or AVX-NE-CONVERT) or disagrees is left out, with a warning;
  2. the rest are timed on the layer's own weight, interleaved, best of a few rounds (the best
     resists other processes' bursts on shared cores). When the model's weights outgrow the
     CPU's last-level cache, each call reads its weight from memory, as in a forward pass:
     the few-row buckets then flush the weight's bytes from every cache level before each
     timed call (``cache_flusher``: CLFLUSH, or DC CIVAC on Arm). Timed hot, a few-row call
     finds the weight its previous call left in the cache, which favours paths that stream a
     plain weight fast from cache (small_gemm: 2.2x F.linear hot at M=1 on a Zen 5, where it
     merely ties oneDNN's packed weight cold, and the plain format it makes the layer keep then
     costs 1.5-2.5x at 8-32 rows). Flushing replaced rotating over copies of the weight that
     outgrew the cache: on a host reporting a 480 MiB L3 those took 64 copies per shape and
     format (up to 4.8 GB at once for one float32 shape; 10.6 of a 12.9 s plan went to making
     them). Without a flush (no extension), few-row buckets are timed hot;
  3. per bucket the fastest wins; a path other than ``torch`` must be ``MARGIN`` faster, so
     that noise does not flip choices between equals (weights under ``MIN_TIMED_WEIGHT``
     elements are not timed: ``torch`` everywhere). In 129..1024 rows a path that builds a
     kernel per row count (oneDNN's) must also be ``BUILD_MARGIN`` faster than one that does
     not, for 16-bit weights: there, timed alone, it looks faster than it runs in the model,
     and each prompt length it has not seen costs a build (``Bucket.build_margin``);
  4. memory: a layer holds one copy of its weight, plain or packed (for oneDNN, amx or MKL),
     whichever format's paths are faster over the buckets (``choose_paths``). A packed weight
     replaces the plain one: the layer's ``weight`` becomes a meta tensor of the same shape
     (``parameters()`` still counts it; reading it fails). A weight another module shares (a
     tied embedding) stays plain; a module that needs weights derived from a planned layer's
     (MLA's absorbed maps) makes them in ``process_weights_after_loading``, before the plans.
     A layer gets a second copy, in another format, only if that makes some bucket
     ``EXTRA_COPY_MARGIN`` (1.05x) faster, and only while the process's budget for
     such copies lasts (``OPENINFER_CPU_GEMM_EXTRA_MEMORY``: a byte size such as ``2GiB``, 0 for
     none; by default a quarter of the memory available at load). The case it is for: on
     Intel cores with AMX, the amx path reads its weight 1.4-2.5x faster than oneDNN for the
     few rows of decode, and oneDNN's packed kernel multiplies prefill's hundreds of rows
     1.1-1.4x faster than the amx path (``bench_gemm_paths``; docs/benchmarks.md): each bucket
     then takes its own copy, for one more weight's worth of memory.

``OPENINFER_CPU_GEMM``: ``auto`` (the default: the above), ``default`` (no plans; ``linear()``
as before), or a path name (that path for every M; an error if it cannot run here). No plans
either for models on other devices (``why_no_plans``). A bf16 model on a CPU with no bf16 GEMM
instructions (AVX2, or AVX-512 without AVX512_BF16) is planned like any other: ATen and oneDNN
convert it element by element there, slower than float32, and the paths that widen it to
float32 in registers (``small_gemm``) or for the call (``widened``) win their buckets.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from openinfer.cpu_features import cpu_capability
from openinfer.kernels.cpu_attention import load_cpu_attention
from openinfer.kernels.gemm_paths import (
    FORMATS,
    PATHS,
    PLAIN,
    Bucket,
    GemmPath,
    weight_formats,
)
from openinfer.units import env_bytes

logger = logging.getLogger(__name__)

ENV_VAR = "OPENINFER_CPU_GEMM"
MARGIN = 1.05
"""A path other than ``torch`` is chosen only if at least this much faster."""
EXTRA_COPY_MARGIN = 1.05
"""A second copy of a weight, in another format, must make some bucket at least this much
faster (the memory budget bounds what copies take). At 1.1, the bf16 512-row bucket's oneDNN
copy (1.1-1.3x the amx path there, by shape) was refused for one to three of the peers
model's four shapes in some plans and not in others, and TTFT moved by 9% between runs."""
EXTRA_MEMORY_ENV = "OPENINFER_CPU_GEMM_EXTRA_MEMORY"
EXTRA_MEMORY_SHARE = 0.25
"""Without ``OPENINFER_CPU_GEMM_EXTRA_MEMORY``, second copies may take this share of the memory
available when the model is planned (the KV cache is sized in bytes, not from what is left)."""
PAD_ROWS = 32
PAD_FROM_ROWS = 128
"""Calls of more rows than this, on paths that build a kernel per row count, run padded to a
multiple of PAD_ROWS: a bf16 prefill at a prompt length seen for the first time took 170 ms
against 143 ms at a length seen before (the peers model, 481-509 tokens; oneDNN created
primitives for its four shapes). Padding costs at most PAD_ROWS - 1 rows of products."""
BUILD_MARGIN = 1.3
"""In 129..1024 rows, a path that builds a kernel per row count (``GemmPath.builds_per_rows``)
is chosen only if this much faster than the others, as timed. On 2 Intel cores with AMX,
oneDNN's packed linear timed alone at 512 rows ran 4-27% ahead of the amx path (by shape), yet
in the model a 512-token prefill ran 1.05x faster on amx, and a prompt length seen for the
first time 1.2x faster (oneDNN builds a primitive per new row count and shape, 3-10 ms each).
Above 1024 rows the timed choice stands: there oneDNN ran 32 x 256-token prefills 1.18x faster
than amx (docs/benchmarks.md, bench_prefill_plans)."""
BUILD_MARGIN_DTYPES = frozenset({torch.bfloat16, torch.float16})
"""The weight dtypes BUILD_MARGIN applies to. Not float32: there the competitor is MKL's sgemm,
and timing alone was right. On 2 Intel cores a plan from timing alone ran float32 prefills as
fast as the plan with the margin (0.94-1.03x, bench_prefill_plans); on 2 AMD EPYC cores
(AVX-512, no AMX), where MKL runs 512 rows 15-20% behind oneDNN, the margin kept MKL, and a
512-token prefill of the peers model took 1.25 s against 1.03 s with oneDNN (a prompt length
seen for the first time, oneDNN's builds included: 1.0-1.15 s against 0.84 s)."""
MIN_TIMED_WEIGHT = 1 << 17
"""Weights with fewer elements (256 x 512) run F.linear in every bucket, untimed: their calls
are mostly overhead, which timing cannot tell from noise, and so the tiny models of tests
compute the same in every process."""
SAMPLE_SECONDS = 5e-4
"""Small calls are timed in batches of about this long (timer resolution, call jitter)."""
BUCKET_SECONDS = 0.01
"""Timing one bucket of one weight shape takes about this long, or two calls per path if
those take longer."""
MIN_ROUNDS = 2
"""Samples per path at least: with one, a single burst from another process on shared cores
decided between paths (a 512-row call took 4x its time once in a handful of plans)."""
COLD_MAX_ROWS = 128
"""Buckets timed at more rows than this are compute-bound: timed hot (their calls reuse each
weight tile over many rows, so where it came from changes nothing there)."""
LARGE_BUCKET_SECONDS = 0.05
"""Those buckets' calls take milliseconds: BUCKET_SECONDS would give each path two samples,
and the choice between copies (1.1-1.4x apart at 512 rows on 2 Intel cores with AMX) would
follow other processes' bursts."""
DEFAULT_CACHE_BYTES = 32 << 20
"""The last-level cache assumed where sysfs does not tell."""


BUCKETS = (Bucket(1, 1, 1), Bucket(2, 16, 8), Bucket(17, 128, 32),
           Bucket(129, 1024, 512, build_margin=BUILD_MARGIN), Bucket(1025, None, 512))


def gemm_mode(mode: str | None = None) -> str:
    """``mode``, or else $OPENINFER_CPU_GEMM, or else 'auto'; raises ValueError if unknown."""
    value = mode if mode is not None else os.environ.get(ENV_VAR, "auto")
    if value not in ("auto", "default", *PATHS):
        raise ValueError(f"{ENV_VAR} must be one of {['auto', 'default', *PATHS]}, got {value!r}")
    return value


@dataclass(frozen=True)
class Route:
    """What one bucket of a plan runs, and what timing said of it."""

    bucket: Bucket
    path: GemmPath
    weight: torch.Tensor
    seconds: float | None
    """Measured seconds per call at ``bucket.timed_rows`` (None: not timed)."""
    torch_seconds: float | None
    """The same for F.linear (the ``torch`` path)."""


class GemmPlan:
    """y = x @ W^T + b for one weight; each call goes to the path chosen for its row count."""

    invariant_sizes: tuple[int, ...] = ()
    """Batch-invariant plans (openinfer.kernels.invariant_gemm): the row counts they run."""

    def __init__(self, routes: Sequence[Route], bias: torch.Tensor | None, extra_bytes: int,
                 seconds: float) -> None:
        self.routes = tuple(routes)
        self.bias = bias
        self.extra_bytes = extra_bytes
        """Bytes held beyond one copy of the weight (a packed copy next to the plain one)."""
        self.seconds = seconds
        """Time spent making this plan (timing, checks, packing)."""
        # The hot path: (largest row count, function, weight, pads) per bucket, in order.
        self._table = [(math.inf if r.bucket.max_rows is None else r.bucket.max_rows,
                        r.path.run, r.weight,
                        r.weight.dtype in r.path.builds_per_rows) for r in self.routes]
        self._out_features = self.routes[0].weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        rows = flat.shape[0]
        for max_rows, run, weight, pads in self._table:
            if rows <= max_rows:
                if pads and rows > PAD_FROM_ROWS and rows % PAD_ROWS:
                    padded = flat.new_empty(rows + PAD_ROWS - rows % PAD_ROWS, flat.shape[1])
                    padded[:rows] = flat
                    padded[rows:].zero_()
                    out = run(padded, weight, self.bias)[:rows]  # leading rows: contiguous
                else:
                    out = run(flat, weight, self.bias)
                return out if x.dim() == 2 else out.view(*x.shape[:-1], self._out_features)
        raise AssertionError("the last bucket has no upper bound")

    @property
    def paths(self) -> list[str]:
        return [r.path.name for r in self.routes]

    @property
    def reads_plain(self) -> bool:
        """Whether some route reads the weight in its plain format (else the layer's loaded
        weight may be freed: see the module docstring)."""
        return any(r.path.weight_format == PLAIN for r in self.routes)


# (N, K, has bias, dtype, timed rows, CPU capability, threads) -> {path: seconds per call}
_timings: dict[tuple, dict[str, float]] = {}


def clear_timing_cache() -> None:
    """Forget measured timings (tests; a process keeps them for its lifetime otherwise)."""
    _timings.clear()


def extra_copy_budget() -> int:
    """Bytes the process's second weight copies may take (see the module docstring); raises
    ValueError for a malformed ``OPENINFER_CPU_GEMM_EXTRA_MEMORY``."""
    value = env_bytes(EXTRA_MEMORY_ENV)
    return int(EXTRA_MEMORY_SHARE * (_available_memory() or 0)) if value is None else value


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes; None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def why_no_plans(weight: torch.Tensor | None, mode: str) -> str | None:
    """Why a model whose first linear layer holds ``weight`` (None: it has none) gets no GEMM
    plans in ``mode``, or None if it does."""
    if mode == "default":
        return f"{ENV_VAR}=default"
    if weight is None:
        return "no linear layers"
    if weight.device.type != "cpu":
        return f"on {weight.device.type}"
    return None


def plan_weight(weight: torch.Tensor, bias: torch.Tensor | None, mode: str, shared: bool,
                flush: Callable[[torch.Tensor], None] | None = None, may_copy: bool = False,
                timed_buckets: int | None = None) -> GemmPlan:
    """The plan for y = x @ weight^T + bias (``mode``: see ``gemm_mode``; ``shared``: another
    module reads the plain weight; ``timed_buckets``: how many of BUCKETS to time, the rest take
    the last timed one's path). Where the plan reads no plain weight (``reads_plain``), the
    caller may free it."""
    start = time.perf_counter()
    buckets = BUCKETS[:timed_buckets]
    weight_in = weight_formats(weight)

    if mode == "auto" and weight.numel() < MIN_TIMED_WEIGHT:
        times, chosen = [{} for _ in buckets], ["torch"] * len(buckets)
    elif mode == "auto":
        times = [_timed(weight, bias, b, weight_in, flush if b.timed_rows <= COLD_MAX_ROWS else None)
                 for b in buckets]
        margin = weight.dtype in BUILD_MARGIN_DTYPES
        weighed = [{p: s * (b.build_margin if margin and weight.dtype in PATHS[p].builds_per_rows
                            else 1.0) for p, s in t.items()} for b, t in zip(buckets, times)]
        chosen = choose_paths(weighed, kept=frozenset({PLAIN}) if shared else frozenset(),
                              may_copy=may_copy)
    else:
        path = PATHS[mode]
        problem = _check(path, weight_in, weight, bias, BUCKETS[0].timed_rows)
        if problem is not None:
            raise ValueError(f"{ENV_VAR}={mode}: {problem}")
        times, chosen = [{} for _ in buckets], [mode] * len(buckets)
    routes = []
    for i, bucket in enumerate(BUCKETS):
        timed = i < len(buckets)
        name = chosen[min(i, len(buckets) - 1)]
        if mode == "auto" and not timed and not PATHS[name].timed_in(bucket):
            name = "torch"  # an untimed bucket beyond what the path is made for (plain, too)
        path = PATHS[name]
        t = times[i] if timed else {}
        routes.append(Route(bucket, path, weight_in(path.weight_format), t.get(name),
                            t.get("torch")))
    formats = {r.path.weight_format for r in routes}
    held = formats | ({PLAIN} if shared else set())  # a shared weight stays plain for its sharer
    extra = (len(held) - 1) * weight.numel() * weight.element_size()
    return GemmPlan(routes, bias, extra, time.perf_counter() - start)


def cache_flusher() -> Callable[[torch.Tensor], None] | None:
    """flush(tensor): the tensor's bytes evicted from every cache level (the CPU extension's
    CLFLUSH pass), or None where the extension cannot be built or the CPU has no such
    instruction."""
    kernels = load_cpu_attention()
    if kernels is None or not kernels.evict_from_cache(0, 0):
        return None

    def flush(t: torch.Tensor) -> None:
        if t.layout == torch._mkldnn:  # oneDNN's packed weight: an opaque tensor
            kernels.evict_from_cache(torch.ops.mkldnn.data_ptr(t), torch.ops.mkldnn._nbytes(t))
        else:
            kernels.evict_from_cache(t.data_ptr(), t.numel() * t.element_size())

    return flush


def _timed(weight: torch.Tensor, bias: torch.Tensor | None, bucket: Bucket,
           weight_in: Callable[[str], torch.Tensor],
           flush: Callable[[torch.Tensor], None] | None = None) -> dict[str, float]:
    """Seconds per call of each path that runs correctly here (cached; see the docstring),
    with the weight flushed from the caches before each call if ``flush`` is given."""
    key = (*weight.shape, bias is not None, weight.dtype, bucket.timed_rows, cpu_capability(),
           torch.get_num_threads(), flush is not None)
    if key not in _timings:
        budget = BUCKET_SECONDS if bucket.timed_rows <= COLD_MAX_ROWS else LARGE_BUCKET_SECONDS
        _timings[key] = time_paths([p for p in PATHS.values() if p.timed_in(bucket)], weight,
                                   bias, bucket.timed_rows, weight_in, budget_s=budget,
                                   flush=flush)
    return _timings[key]


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2


def _mismatch(out: torch.Tensor, reference: torch.Tensor) -> str | None:
    """Why ``out`` is not F.linear's ``reference`` within the dtype's tolerance, or None.
    Non-finite outputs (a weight holding inf) must sit where the reference has them."""
    if out.shape != reference.shape:
        return f"gives shape {tuple(out.shape)}, F.linear {tuple(reference.shape)}"
    finite = reference.isfinite()
    if not torch.equal(finite, out.isfinite()):
        return "has non-finite values where F.linear has none, or the reverse"
    if not finite.any():
        return None
    ref, got = reference[finite].float(), out[finite].float()
    scale = ref.abs().max().item() or 1.0
    err = (got - ref).abs().max().item()
    if not err <= _tolerance(reference.dtype) * scale:
        return f"differs from F.linear by {err:.3g} (largest output {scale:.3g})"
    return None


def _check(path: GemmPath, weight_in: Callable[[str], torch.Tensor], weight: torch.Tensor,
           bias: torch.Tensor | None, rows: int) -> str | None:
    """Why ``path`` cannot compute this layer's product at ``rows`` rows, or None."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    try:
        return _mismatch(path.run(x, weight_in(path.weight_format), bias), F.linear(x, weight, bias))
    except RuntimeError as e:
        return f"{path.name} fails: {str(e).splitlines()[0]}"


def time_paths(paths: Sequence[GemmPath], weight: torch.Tensor, bias: torch.Tensor | None,
               rows: int, weight_in: Callable[[str], torch.Tensor],
               budget_s: float = BUCKET_SECONDS,
               flush: Callable[[torch.Tensor], None] | None = None) -> dict[str, float]:
    """Best seconds per call of each of ``paths`` on ``rows`` random rows; paths that raise or
    disagree with F.linear are left out (with a warning). ``paths`` must include ``torch``.
    ``flush``: evicts a weight from the caches, then called before every timed call (cold
    timing, see the module docstring), each call a sample of its own.

    Each path's first call is checked (and, timed hot, is its first sample: oneDNN builds its
    primitive then, which shows only on calls too small to matter). Then rounds run every path again,
    in rotating order: MIN_ROUNDS at least, more while ``budget_s`` lasts (at most 5). Hot calls
    shorter than SAMPLE_SECONDS are timed in batches.
    """
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    start = time.perf_counter()
    reference = F.linear(x, weight, bias)
    first = {"torch": time.perf_counter() - start}
    calls: dict[str, tuple[Callable, torch.Tensor]] = {}
    for path in paths:
        try:
            w = weight_in(path.weight_format)
            start = time.perf_counter()
            out = reference if path.name == "torch" else path.run(x, w, bias)
            seconds = time.perf_counter() - start
        except RuntimeError as e:
            logger.debug("GEMM path %s cannot run %s %s: %s", path.name, tuple(weight.shape),
                         weight.dtype, str(e).splitlines()[0])
            continue
        problem = None if path.name == "torch" else _mismatch(out, reference)
        if problem is not None:
            logger.warning("GEMM path %s left out for %s %s: %s", path.name, tuple(weight.shape),
                           weight.dtype, problem)
            continue
        first.setdefault(path.name, seconds)
        calls[path.name] = (path.run, w)
    names = list(calls)
    # A first call read a weight the reference had just read: a hot sample, left out of cold timing.
    best = {n: math.inf if flush else first[n] for n in names}
    repeat = {n: 1 if flush else max(1, min(50, round(SAMPLE_SECONDS / max(first[n], 1e-7))))
              for n in names}
    per_round = max(1e-9, sum(first[n] * repeat[n] for n in names))
    rounds = max(MIN_ROUNDS, min(5, int(budget_s / per_round)))
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            run, w = calls[name]
            if flush is not None:
                flush(w)
            start = time.perf_counter()
            for _ in range(repeat[name]):
                run(x, w, bias)
            best[name] = min(best[name], (time.perf_counter() - start) / repeat[name])
    return {n: best[n] for n in names}


def _handicapped(times: Mapping[str, float], path: str) -> float:
    """``path``'s time as choices weigh it: paths other than torch must be MARGIN faster."""
    return times[path] * (1.0 if path == "torch" else MARGIN)


def _fastest(times: Mapping[str, float], formats: frozenset[str]) -> str | None:
    """The path to run among those reading ``formats``."""
    usable = [p for p in times if PATHS[p].weight_format in formats]
    return min(usable, key=lambda p: _handicapped(times, p)) if usable else None


def choose_paths(times: Sequence[Mapping[str, float]], kept: frozenset[str] = frozenset(),
                 may_copy: bool = False) -> list[str]:
    """Per bucket, the path to run, from seconds per call (``times[i][path]``, bucket i; each
    must include ``torch``).

    The layer's first copy of its weight: plain if ``kept`` says so (another module shares
    it), else the format, plain or packed (PACKED, AMX or MKL), whose paths' times summed over
    buckets, each relative to the bucket's best (MARGIN counted against paths other than
    torch), score lowest; plain wins unless the best packed format scores MARGIN lower.
    With ``may_copy``, a second copy in another format, the one gaining most, if it makes some
    bucket EXTRA_COPY_MARGIN faster; each bucket then takes the faster of the two.
    """
    best = [min(t.values()) for t in times]

    def option(formats: frozenset[str]) -> tuple[float, list[str]] | None:
        picks = [_fastest(t, formats) for t in times]
        if None in picks:
            return None
        return sum(_handicapped(t, p) / b for t, p, b in zip(times, picks, best)), picks

    plain = option(frozenset({PLAIN}))
    if plain is None:
        raise ValueError("choose_paths needs the torch path's time in every bucket")
    first = frozenset({PLAIN})
    chosen = plain
    if not kept:
        packed = [(fmt, o) for fmt in FORMATS if fmt != PLAIN
                  if (o := option(frozenset({fmt}))) is not None]
        if packed:
            fmt, best_packed = min(packed, key=lambda fo: fo[1][0])
            if best_packed[0] * MARGIN < plain[0]:
                first, chosen = frozenset({fmt}), best_packed
    if not may_copy:
        return chosen[1]

    def gain(o: tuple[float, list[str]]) -> float:
        return max(t[a] / t[b] for t, a, b in zip(times, chosen[1], o[1]))

    copies = [o for fmt in FORMATS if fmt not in first
              if (o := option(first | {fmt})) is not None]
    if not copies:
        return chosen[1]
    best_copy = max(copies, key=gain)
    return best_copy[1] if gain(best_copy) >= EXTRA_COPY_MARGIN else chosen[1]
