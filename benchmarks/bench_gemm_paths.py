"""CPU GEMM paths side by side: F.linear against each path a GEMM plan can take.

Times y = x @ W^T on the peers model's projection shapes (Qwen3 0.4B: hidden 1024,
intermediate 3072, 16/8 heads of 64, vocab 32000; /work/shared/peers/make_model.py) for
M = 1, 32 and 512 rows, in float32 and bfloat16.
Every round runs every path once per cell, in rotating order (interleaved, so that other
processes' load hits all paths alike); a cell reports the median over rounds of the
per-round speedup over F.linear, with its range.

    .venv/bin/python benchmarks/bench_gemm_paths.py [--rounds 7] [--cold] [--plan-model smollm2]

``--plan-model`` also loads a model and reports its GEMM plans and what they cost at start-up.
``--output docs/benchmarks.md`` writes the table as that file's ``bench_gemm_paths`` section.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from openinfer.cpu_features import (
    cpu_capability,
    cpu_flags,
    cpu_model_name,
    has_native_bf16,
    last_level_cache_bytes,
)
from openinfer.kernels.gemm_paths import PATHS, weight_formats
from openinfer.kernels.gemm_plan import DEFAULT_CACHE_BYTES

SHAPES = {"qkv": (2048, 1024), "o": (1024, 1024), "gate_up": (6144, 1024), "down": (1024, 3072),
          "lm_head": (32000, 1024)}  # name: (N, K)
ROWS = (1, 32, 512)
LM_HEAD_MAX_ROWS = 32  # logits are computed for each sequence's last token only
SAMPLE_SECONDS = 0.005
COLD_CACHE_MULTIPLE = 4
"""--cold rotates over copies of a weight that together hold this many times the last-level
cache sysfs reports (a 2-core slice of a Zen 5 reports 32 MiB but kept a 64 MiB rotation partly
cached: 1024x1024 float32 at M=1 took 106 us there, 123 us at 256 MiB)."""
MAX_COLD_COPIES = 64


def cold_copies(weight: torch.Tensor) -> int:
    """Copies of ``weight`` that together hold COLD_CACHE_MULTIPLE times the last-level cache
    (at most MAX_COLD_COPIES): calls rotating over them read their weight from memory."""
    cache = last_level_cache_bytes() or DEFAULT_CACHE_BYTES
    size = weight.numel() * weight.element_size()
    return max(1, min(MAX_COLD_COPIES, math.ceil(COLD_CACHE_MULTIPLE * cache / size)))


def candidates(ws: list[torch.Tensor], rows: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Path name -> fn(x), for the paths that run here for this dtype ('F.linear' first). Each
    fn's successive calls rotate over the copies ``ws`` of the weight (cold timing when they
    outgrow the cache, as a forward pass reads each weight from memory)."""
    plain = itertools.cycle(ws)
    fns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "F.linear": lambda x: F.linear(x, next(plain))}
    formats = [weight_formats(w) for w in ws]
    for name, path in PATHS.items():
        if name == "torch" or (name == "torch_t" and rows == 1):
            continue
        try:
            weights = [weight_in(path.weight_format) for weight_in in formats]
            path.run(torch.randn(rows, ws[0].shape[1], dtype=ws[0].dtype), weights[0], None)
        except RuntimeError:
            continue
        rotation = itertools.cycle(weights)
        fns[name] = lambda x, run=path.run, it=rotation: run(x, next(it), None)
    return fns


def measure(n: int, k: int, rows: int, dtype: torch.dtype, rounds: int,
            cold: bool = False) -> dict[str, list[float]]:
    """Per path, the per-round speedups over F.linear (seconds per call of F.linear / path)."""
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    copies = cold_copies(w) if cold else 1
    x = torch.randn(rows, k, dtype=dtype)
    fns = candidates([w] * copies if copies == 1 else [w] + [w.clone() for _ in range(copies - 1)],
                     rows)
    reference = F.linear(x.float(), w.float())
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for name, fn in fns.items():  # warm-up and correctness (every copy holds the same values)
        err = (fn(x).float() - reference).abs().max().item()
        assert err <= tolerance * reference.abs().max().item(), f"{name} is wrong by {err}"
    repeat = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        fn(x)
        repeat[name] = max(1, round(SAMPLE_SECONDS / (time.perf_counter() - start)))
    names = list(fns)
    ratios: dict[str, list[float]] = {name: [] for name in names[1:]}
    for r in range(rounds):
        seconds = {}
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[name]
            start = time.perf_counter()
            for _ in range(repeat[name]):
                fn(x)
            seconds[name] = (time.perf_counter() - start) / repeat[name]
        for name in names[1:]:
            ratios[name].append(seconds["F.linear"] / seconds[name])
    return ratios


def table(dtype: torch.dtype, rounds: int, cold: bool = False) -> list[str]:
    paths = [p for p in PATHS if p != "torch"]
    lines = ["| shape (N x K) | M | " + " | ".join(paths) + " |", "|---" * (len(paths) + 2) + "|"]
    print("\n".join(lines), flush=True)
    for name, (n, k) in SHAPES.items():
        for rows in ROWS:
            if name == "lm_head" and rows > LM_HEAD_MAX_ROWS:
                continue
            ratios = measure(n, k, rows, dtype, rounds, cold)
            cells = []
            for path in paths:
                r = ratios.get(path)
                cells.append("-" if not r else
                             f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})")
            lines.append(f"| {name} {n}x{k} | {rows} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    return lines


def plan_report(model: str) -> list[str]:
    from openinfer.config import ModelConfig
    from openinfer.models.gemm_plans import describe_gemms
    from openinfer.models.loader import load_model

    config = ModelConfig.from_pretrained(model)
    start = time.perf_counter()
    load_model(config, progress=False, gemm="default")
    plain = time.perf_counter() - start
    start = time.perf_counter()
    summary = describe_gemms(load_model(config, progress=False))
    planned = time.perf_counter() - start
    return [f"- `{model}` ({str(config.dtype).removeprefix('torch.')}): load {plain:.2f} s without "
            f"plans, {planned:.2f} s with (planning {summary.seconds:.2f} s: timing, checks, "
            f"packing); paths {summary.label}", f"  - {summary.text}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cold", action="store_true",
                        help="rotate over copies of each weight that outgrow the last-level cache "
                             "(as the engine's planner times few-row GEMMs): weights read from memory")
    parser.add_argument("--plan-model", default=None)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    flags = cpu_flags()
    header = [
        "## CPU GEMM paths",
        "",
        f"- Date: {dt.datetime.now():%Y-%m-%d %H:%M}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; CPU {cpu_model_name()}, capability "
        f"{cpu_capability()}, bf16 flags: "
        f"{', '.join(f for f in ('avx512_bf16', 'amx_bf16') if f in flags) or 'none'}; "
        f"load average {os.getloadavg()[0]:.1f} at start.",
        f"- Speedup over F.linear, median of {args.rounds} interleaved rounds (range); "
        + ("cold: each call reads its weight from memory (calls rotate over copies of it that "
           "outgrow the last-level cache). " if args.cold else
           "hot: the same weight every call (it stays in cache where it fits). ") +
        "Paths: openinfer/kernels/gemm_paths.py.",
        "",
    ]
    print("\n".join(header), flush=True)
    print("### float32\n", flush=True)
    body = [*header, "### float32", "", *table(torch.float32, args.rounds, args.cold), ""]
    print("### bfloat16\n", flush=True)
    body += ["### bfloat16", ""]
    if not has_native_bf16(flags):
        body += ["This CPU has no AVX512_BF16 or AMX_BF16 (no bf16 dot-product instructions): "
                 "F.linear converts bf16 element by element here, and oneDNN refuses bf16 "
                 "without AVX-512 BW/VL/DQ or AVX-NE-CONVERT; `small_gemm` and `widened` "
                 "widen it to float32 instead.", ""]
    body += [*table(torch.bfloat16, args.rounds, args.cold), ""]
    if args.plan_model:
        body += ["### GEMM plans at load", "", *plan_report(args.plan_model)]
        print("\n".join(body[-2:]))
    if args.output is not None:
        from doc_sections import write_section

        write_section(args.output, "bench_gemm_paths", "\n".join(body))


if __name__ == "__main__":
    main()
