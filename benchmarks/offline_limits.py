"""Machine limits for bench_offline.py: float32 matmul rate, memory bandwidth, and the
noise helpers that see how much CPU other processes use while a phase runs."""

from __future__ import annotations

import os
import platform
import resource
import time
from collections.abc import Callable
from pathlib import Path


def best_limits(runs: list[dict]) -> dict:
    """Per measure, the best of several limits runs (contention only ever lowers a rate)."""
    best = dict(runs[0])
    best["matmul_flops"] = {k: max(r["matmul_flops"][k] for r in runs) for k in runs[0]["matmul_flops"]}
    for key in ("copy_read_bytes_per_s", "sum_read_bytes_per_s", "gemv_read_bytes_per_s"):
        best[key] = max(r[key] for r in runs)
    return best


def shape_key(shape: tuple[int, int, int]) -> str:
    return "x".join(map(str, shape))


def matmul_flops(m: int, k: int, n: int, seconds: float) -> float:
    """FLOP/s of float32 [m x k] @ [k x n] (the weight stored [n x k], as nn.Linear does)."""
    import torch

    x, w = torch.randn(m, k), torch.randn(n, k)
    out = torch.empty(m, n)
    for _ in range(3):
        torch.mm(x, w.t(), out=out)
    iters, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        torch.mm(x, w.t(), out=out)
        iters += 1
    return 2.0 * m * k * n * iters / elapsed


def copy_read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes READ per second by `dst.copy_(src)` of a float32 tensor of nbytes (best of repeats)."""
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault in dst's pages before timing
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return nbytes / best


def sum_read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes read per second by `src.sum()` of a float32 tensor of nbytes: reads, no writes."""
    import torch

    src = torch.ones(nbytes // 4)
    src.sum()
    best = min(_timed(lambda: src.sum()) for _ in range(repeats))
    return nbytes / best


def gemv_read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Weight bytes read per second by a one-token F.linear over a float32 matrix of nbytes."""
    import torch
    import torch.nn.functional as F

    k = 1024
    w = torch.randn(nbytes // 4 // k, k)
    x = torch.randn(1, k)
    F.linear(x, w)
    best = min(_timed(lambda: F.linear(x, w)) for _ in range(repeats))
    return nbytes / best


# --------------------------------------------------------------------------- noise


def cpu_busy_seconds() -> float:
    """CPU-seconds that all processes of the machine spent busy so far (/proc/stat), 0 if unknown."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return 0.0
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values) - idle) / os.sysconf("SC_CLK_TCK")


def wait_until_quiet(max_wait_s: float, threshold: float = 0.2, window_s: float = 2.0) -> float:
    """Wait (up to max_wait_s) until other processes use under `threshold` cores; returns seconds waited."""
    start = time.perf_counter()
    while True:
        busy = cpu_busy_seconds()
        time.sleep(window_s)
        load = (cpu_busy_seconds() - busy) / window_s
        waited = time.perf_counter() - start
        if load < threshold or waited >= max_wait_s:
            return waited


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
