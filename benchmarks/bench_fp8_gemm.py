"""A block-scaled fp8 weight kept as loaded (openinfer/kernels/fp8_gemm.py) beside the same weight
held dequantized in bf16 and in fp32, on decode's row counts.

For each DeepSeek-V3 projection shape and row count, every round times, in rotating order
(interleaved, so other processes' load hits all alike), over copies of the weight that together
exceed the last-level cache (a decode reads its weights from memory):

    fp8            fp8_linear: the fp8 kernel up to FP8_KERNEL_MAX_ROWS rows, else the weight
                   dequantized for the call and F.linear
    fp8 dequant    the F.linear path at every row count (where the kernel hands over)
    bf16 / fp32    the weight held dequantized: small_gemm up to FP8_KERNEL_MAX_ROWS rows, then
                   F.linear (bf16: widened to fp32 for the call, the planner's path on CPUs
                   without bf16 instructions)

A cell reports the median time and the fp8 path's speedup over it, with the weight bytes each
reads per call.

    .venv/bin/python benchmarks/bench_fp8_gemm.py [--rounds 7] [--output docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from openinfer.cpu_features import cpu_capability, cpu_model_name, last_level_cache_bytes
from openinfer.kernels.cpu_attention import load_cpu_attention
from openinfer.kernels.fp8_gemm import FP8_KERNEL_MAX_ROWS, _dequantized_linear, fp8_linear
from openinfer.kernels.gemm_plan import DEFAULT_CACHE_BYTES

SHAPES = {"q_a+kv_a": (2112, 7168), "o_proj, shared down": (7168, 2048), "q_b": (3072, 1536)}
ROWS = (1, 4, 16, 32, 128)
BLOCK = (128, 128)
SAMPLE_SECONDS = 0.01


def _copies(nbytes: int) -> int:
    cache = last_level_cache_bytes() or DEFAULT_CACHE_BYTES
    return max(2, min(32, math.ceil(4 * cache / nbytes)))


def _time(fn: Callable[[int], torch.Tensor], copies: int) -> float:
    calls, start = 0, time.perf_counter()
    while True:
        fn(calls % copies)
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed > SAMPLE_SECONDS and calls >= copies:
            return elapsed / calls


Timed = dict[str, Callable[[int], torch.Tensor]]


def _contenders(n: int, k: int, rows: int, ext) -> tuple[Timed, dict[str, int]]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02
    nb, kb = -(-n // BLOCK[0]), -(-k // BLOCK[1])  # (edge tiles may be partial)
    padded = F.pad(w.abs(), (0, kb * BLOCK[1] - k, 0, nb * BLOCK[0] - n))
    scale = padded.reshape(nb, BLOCK[0], kb, BLOCK[1]).amax((1, 3)).clamp(min=1e-12) / 448
    full = scale.repeat_interleave(BLOCK[0], 0)[:n].repeat_interleave(BLOCK[1], 1)[:, :k]
    q = (w / full).to(torch.float8_e4m3fn)
    copies = _copies(n * k)
    fp8 = [(q.clone(), scale.clone()) for _ in range(copies)]
    x32 = torch.randn(rows, k)
    bf16 = [w.bfloat16() for _ in range(copies)]
    fp32 = [w.clone() for _ in range(min(copies, _copies(n * k * 4)))]
    xb = x32.bfloat16()

    def held(weights, x):
        def run(i):
            weight = weights[i % len(weights)]
            if rows <= FP8_KERNEL_MAX_ROWS and ext is not None:
                out = torch.empty(rows, n, dtype=x.dtype)
                ext.small_gemm(out, x, weight, None)
                return out
            if weight.dtype == torch.bfloat16:  # widened
                return F.linear(x.float(), weight.float())
            return F.linear(x, weight)
        return run

    fns = {
        "fp8": lambda i: fp8_linear(xb, fp8[i][0], fp8[i][1], BLOCK),
        "fp8 dequant": lambda i: _dequantized_linear(xb, fp8[i][0], fp8[i][1], BLOCK, None),
        "bf16": held(bf16, xb),
        "fp32": held(fp32, x32),
    }
    return fns, {"fp8": copies, "fp8 dequant": copies, "bf16": copies, "fp32": len(fp32)}


def table(rounds: int) -> list[str]:
    ext = load_cpu_attention()
    lines = ["| shape (N x K) | rows | fp8 | fp8 dequant | bf16 held | fp32 held | fp8 GB/s |",
             "|---|---|---|---|---|---|---|"]
    for name, (n, k) in SHAPES.items():
        for rows in ROWS:
            fns, copies = _contenders(n, k, rows, ext)
            times: dict[str, list[float]] = {key: [] for key in fns}
            for r in range(rounds):
                order = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
                for key in order:
                    times[key].append(_time(fns[key], copies[key]))
            med = {key: statistics.median(v) for key, v in times.items()}
            base = med["fp8"]
            cells = [f"{med[key] * 1e6:.0f} us" + ("" if key == "fp8" else f" ({med[key] / base:.2f}x)")
                     for key in fns]
            lines.append(f"| {name} ({n}x{k}) | {rows} | " + " | ".join(cells)
                         + f" | {n * k / base / 1e9:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--output", help="write the table as this page's bench_fp8_gemm section")
    args = parser.parse_args()
    body = [f"`benchmarks/bench_fp8_gemm.py --rounds {args.rounds}`: y = x @ W^T for a "
            f"DeepSeek-V3 projection in block-scaled fp8 ({BLOCK[0]}x{BLOCK[1]} tiles) kept as "
            "loaded, beside the same weight held in bf16 and fp32 (x in bf16; weights rotated "
            "over copies beyond the last-level cache; median of rounds; (Nx) = that path's time "
            f"over fp8's). The fp8 kernel runs up to {FP8_KERNEL_MAX_ROWS} rows. "
            f"CPU: {cpu_model_name()}, {cpu_capability()}, {torch.get_num_threads()} threads.", "",
            *table(args.rounds)]
    print("\n".join(body))
    if args.output:
        from doc_sections import write_section

        write_section(args.output, "bench_fp8_gemm", "\n".join(body))


if __name__ == "__main__":
    main()
