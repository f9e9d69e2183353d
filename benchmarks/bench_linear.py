"""The CPU GEMM orientation behind `openinfer.layers.linear.linear`.

Times y = x @ W^T for the benchmark model's projection shapes at several row counts,
computed two ways in the same run: `F.linear(x, W)` and `(W @ x^T)^T` (made contiguous,
as the engine does). Writes the ratio table to docs/benchmarks.md.

    .venv/bin/python benchmarks/bench_linear.py
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from doc_sections import write_section

ROWS = (1, 4, 16, 32, 64, 128, 256, 512, 2048)
SHAPES = ((1024, 2048), (1024, 6144), (2048, 1024), (3072, 1024), (1024, 32000))  # (K, N)


def seconds(fn, reps: int) -> float:
    fn()
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def measure(rows: int, k: int, n: int) -> tuple[float, float]:
    """GFLOP/s of (plain, transposed)."""
    x, w = torch.randn(rows, k), torch.randn(n, k)
    reps = max(3, min(30, 4096 // rows))
    plain = seconds(lambda: F.linear(x, w), reps)
    transposed = seconds(lambda: torch.mm(w, x.t()).t().contiguous(), reps)
    flop = 2 * rows * k * n / 1e9
    return flop / plain, flop / transposed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args()
    header = "| rows | " + " | ".join(f"[{k}x{n}] plain / transposed GFLOP/s (ratio)"
                                       for k, n in SHAPES) + " |"
    lines = [header, "|---" * (len(SHAPES) + 1) + "|"]
    for rows in ROWS:
        cells = []
        for k, n in SHAPES:
            plain, transposed = measure(rows, k, n)
            cells.append(f"{plain:.0f} / {transposed:.0f} ({transposed / plain:.2f}x)")
        lines.append(f"| {rows} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    body = "\n".join([
        "## CPU linear: GEMM orientation",
        "",
        f"- Date: {dt.datetime.now():%Y-%m-%d %H:%M}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, float32.",
        "- `plain` = `F.linear(x, W)`; `transposed` = `(W @ x^T)^T` made contiguous. "
        "openinfer uses the transposed form on CPU for 2..256 rows "
        "(`openinfer/layers/linear.py`), the plain form otherwise.",
        "",
        *lines,
    ])
    write_section(args.output, "bench_linear", body)


if __name__ == "__main__":
    main()
