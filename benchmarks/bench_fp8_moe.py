"""A mixture-of-experts layer's routed experts held as a block-scaled fp8 checkpoint stores them
(one byte per weight, a scale per 128x128 tile, openinfer/kernels/fused_moe.py), beside the same
experts held dequantized in bf16 and fp32, and experts of that shape held as MXFP4 (DeepSeek-V4's
release: half a byte per weight, a scale per 32 inputs of a row), all in the fused CPU kernel.

DeepSeek-V2-Lite's expert shape (hidden 2048, 64 routed experts of 1408, top-6) at decode's and
prefill's token counts. Every round times the three in rotating order (interleaved, so other
processes' load hits all alike); the experts together exceed the last-level cache, so a decode
step reads its experts' weights from memory. A cell is the median time and (for bf16 and fp32)
that time over fp8's; the experts' resident bytes are in the header.

    .venv/bin/python benchmarks/bench_fp8_moe.py [--rounds 7] [--output docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from openinfer.cpu_features import cpu_capability, cpu_model_name
from openinfer.kernels.cpu_attention import load_cpu_attention
from openinfer.kernels.custom_op import Platform
from openinfer.kernels.fp8_gemm import dequantize
from openinfer.layers.moe import FusedExperts
from openinfer.models.platform import bind_platform

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 1408, 64, 6
BLOCK = (128, 128)
TOKENS = (1, 4, 32, 256)
SAMPLE_SECONDS = 0.2


def _quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 values and per-tile scales of ``t`` [N, K] (the absmax of each tile to 448)."""
    n, k = t.shape
    rows, cols = BLOCK
    scale = t.abs().view(n // rows, rows, k // cols, cols).amax((1, 3)).clamp(min=1e-12) / 448
    full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    return (t / full).to(torch.float8_e4m3fn), scale


def _experts(kernels) -> dict[str, FusedExperts]:
    """The same experts three ways, each bound to the cpu backend (packed for the kernel)."""
    torch.manual_seed(0)
    fp8 = FusedExperts(EXPERTS, HIDDEN, INTER)
    dense = copy.deepcopy(fp8)
    assert fp8.keep_fp8(BLOCK)
    with torch.no_grad():
        for e in range(EXPERTS):
            for part in (0, 1):
                q, s = _quantize(torch.randn(INTER, HIDDEN) * 0.02)
                fp8.w13[e, part * INTER:(part + 1) * INTER] = q
                fp8.w13_scale_inv[e, part] = s
                dense.w13[e, part * INTER:(part + 1) * INTER] = dequantize(q, s, BLOCK)
            q, s = _quantize(torch.randn(HIDDEN, INTER) * 0.02)
            fp8.w2[e], fp8.w2_scale_inv[e] = q, s
            dense.w2[e] = dequantize(q, s, BLOCK)
    fp4 = FusedExperts(EXPERTS, HIDDEN, INTER)
    assert fp4.keep_fp4()
    with torch.no_grad():  # (random bytes and unit-ish scales: the timing does not read values)
        fp4.w13.copy_(torch.randint(0, 256, fp4.w13.shape, dtype=torch.uint8))
        fp4.w2.copy_(torch.randint(0, 256, fp4.w2.shape, dtype=torch.uint8))
        fp4.w13_scale_inv.fill_(2.0 ** -8)
        fp4.w2_scale_inv.fill_(2.0 ** -8)
    held = {"fp8": fp8, "fp4": fp4, "bf16": copy.deepcopy(dense).bfloat16(), "fp32": dense}
    for experts in held.values():
        bind_platform(experts, Platform("cpu", kernels))
        assert experts.forward_path == "forward_cpu"
    return held


def _bytes(experts: FusedExperts) -> int:
    p = experts.packed
    return sum(t.numel() * t.element_size() for t in (p.w13, p.w2, p.w13_scale, p.w2_scale)
               if t is not None)


def _seconds(fn) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < SAMPLE_SECONDS:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def table(rounds: int) -> tuple[list[str], dict[str, int]]:
    held = _experts(load_cpu_attention())
    lines = ["| tokens | experts hit | fp8 | MXFP4 | bf16 held | fp32 held |", "|---|---|---|---|---|---|"]
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for tokens in TOKENS:
            ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
            weights = torch.rand(tokens, TOP_K, generator=g)
            x = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
            xs = {"fp8": x, "fp4": x, "bf16": x, "fp32": x.float()}  # (a layer's input is in its dtype)
            fns = {name: (lambda e=e, x=xs[name], w=weights, i=ids: e(x, w, i)) for name, e in held.items()}
            times: dict[str, list[float]] = {name: [] for name in fns}
            for r in range(rounds):
                order = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
                for name in order:
                    times[name].append(_seconds(fns[name]))
            med = {name: statistics.median(t) for name, t in times.items()}
            cells = [f"{med[n] * 1e3:.2f} ms" + ("" if n == "fp8" else f" ({med[n] / med['fp8']:.2f}x)")
                     for n in fns]
            lines.append(f"| {tokens} | {int(torch.unique(ids).numel())} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    return lines, {name: _bytes(e) for name, e in held.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--output", help="write the table as this page's bench_fp8_moe section")
    args = parser.parse_args()
    lines, sizes = table(args.rounds)
    size = ", ".join(f"{name} {b / 2**20:.0f} MiB" for name, b in sizes.items())
    body = [f"`benchmarks/bench_fp8_moe.py --rounds {args.rounds}`: the routed experts of a "
            f"DeepSeek-V2-Lite-shaped MoE layer ({EXPERTS} experts of {INTER}, hidden {HIDDEN}, "
            f"top-{TOP_K}) in the fused CPU kernel, held as block-scaled fp8 ({BLOCK[0]}x{BLOCK[1]} "
            "tiles, as loaded) beside the same experts dequantized to bf16 and fp32, and as "
            "MXFP4 (x in bf16, fp32 for fp32; "
            "median of interleaved rounds; (Nx) = that time over fp8's). Resident expert bytes: "
            f"{size}. CPU: {cpu_model_name()}, {cpu_capability()}, {torch.get_num_threads()} threads.",
            "", *lines]
    print("\n".join(body))
    if args.output:
        from doc_sections import write_section

        write_section(args.output, "bench_fp8_moe", "\n".join(body))


if __name__ == "__main__":
    main()
