"""Decode attention against the memory it reads: does the kernel overlap its loads with its
arithmetic on this CPU, or does it pay for both?

One engine-like block-major cache ``[blocks, 16 layers, 2, 16, 8, 64]`` holds the peers' W1
decode batch (32 sequences x 320 tokens; a prompt's blocks consecutive, decode blocks
interleaved as the allocator hands them out). Per layer, in ms and GB/s of K/V read:

    read cold     ``cache[:, layer].sum()`` (as float32 words) for each layer in turn, after reading a buffer
                  bigger than the model's weights: the same 32 KiB runs at the same stride,
                  with nothing to compute
    read warm     the same for one layer, again and again (it stays in the last-level cache)
    kernel cold   the paged attention kernel, one layer after another, each after a 32-row
                  GEMM over 24 MiB of weights (a decode step's pattern), after the same
                  eviction
    kernel warm   the kernel on one layer, again and again

If loads and arithmetic overlapped, ``kernel cold`` would be about max(read cold, kernel
warm); where they do not, it is near their sum. Rounds interleave the four; medians.

    .venv/bin/python benchmarks/bench_decode_memory.py [--rounds 9] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from openinfer.kernels.cpu_attention import choose_bf16_dot, paged_attention  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 16, 8, 64, 16
SEQS, PROMPT, CONTEXT = 32, 256, 320


def block_tables() -> list[list[int]]:
    """Each prompt's blocks in a run; decode blocks one per sequence in turn."""
    prompt_blocks, blocks = PROMPT // BLOCK, -(-CONTEXT // BLOCK)
    return [list(range(s * prompt_blocks, (s + 1) * prompt_blocks))
            + [SEQS * prompt_blocks + j * SEQS + s for j in range(blocks - prompt_blocks)]
            for s in range(SEQS)]


def measure(dtype: torch.dtype, rounds: int) -> dict[str, float]:
    tables = block_tables()
    cache = torch.randn(SEQS * len(tables[0]), LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    views = [cache[:, layer].transpose(0, 1) for layer in range(LAYERS)]
    weights = [torch.randn(12 << 10, 1024, dtype=torch.bfloat16) for _ in range(LAYERS)]
    evict = torch.empty(512 << 20, dtype=torch.uint8).fill_(1)
    x = torch.randn(32, 1024, dtype=torch.bfloat16)
    q = torch.randn(SEQS, HEADS, HEAD_DIM, dtype=dtype)
    out = torch.empty_like(q)
    table = torch.tensor(tables, dtype=torch.int32)
    starts = torch.arange(SEQS + 1, dtype=torch.int32)
    lens = torch.full((SEQS,), CONTEXT, dtype=torch.int32)
    if dtype == torch.bfloat16:
        choose_bf16_dot(HEADS, KV_HEADS, HEAD_DIM, BLOCK)  # the engine's choice of product path

    def attend(layer: int) -> None:
        paged_attention(out, q, views[layer][0], views[layer][1], table, starts, lens,
                        HEAD_DIM ** -0.5, 1)

    def per_layer(step, layers) -> float:
        total = 0.0
        for layer in layers:
            before = time.perf_counter()
            step(layer)
            total += time.perf_counter() - before
        return total / len(layers) * 1e3

    # The K/V bytes as float32 words (a bf16 pair reads as one finite float): torch's float32
    # sum streams a strided view; its bf16 and integer sums do not (2 GB/s).
    words = cache.view(torch.float32)

    def read(layer: int) -> None:
        words[:, layer].sum()

    samples: dict[str, list[float]] = {k: [] for k in ("read cold", "read warm", "kernel cold",
                                                       "kernel warm")}
    every, one = list(range(LAYERS)), [LAYERS // 2] * LAYERS
    attend(0)
    for _ in range(rounds):
        evict.sum()
        samples["read cold"].append(per_layer(read, every))  # after the eviction above
        samples["read warm"].append(per_layer(read, one))
        evict.sum()
        samples["kernel cold"].append(_kernel_cold(attend, weights, x))
        samples["kernel warm"].append(per_layer(attend, one))
    return {k: statistics.median(v) for k, v in samples.items()}


def _kernel_cold(attend, weights: list[torch.Tensor], x: torch.Tensor) -> float:
    """ms per layer of the kernel, each call after the layer's GEMM (not timed)."""
    total = 0.0
    for layer, weight in enumerate(weights):
        torch.nn.functional.linear(x, weight)
        before = time.perf_counter()
        attend(layer)
        total += time.perf_counter() - before
    return total / len(weights) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        ms = measure(dtype, args.rounds)
        mib = SEQS * CONTEXT * KV_HEADS * HEAD_DIM * 2 * dtype.itemsize / 2**20
        gbs = {k: mib * 2**20 / (v / 1e3) / 1e9 for k, v in ms.items()}
        overlap = max(ms["read cold"], ms["kernel warm"])
        added = ms["read cold"] + ms["kernel warm"]
        rows.append(f"| {str(dtype).removeprefix('torch.')} | {mib:.0f} MiB | "
                    + " | ".join(f"{ms[k]:.3f} ({gbs[k]:.1f})" for k in ms)
                    + f" | {overlap:.3f} | {added:.3f} |")
        print(rows[-1], flush=True)
    body = "\n".join([
        "## Decode attention against the memory it reads (benchmarks/bench_decode_memory.py)",
        "",
        f"The peers' W1 decode batch ({SEQS} x {CONTEXT} keys, {KV_HEADS} KV heads of {HEAD_DIM}) in "
        f"a {LAYERS}-layer block-major cache, {torch.get_num_threads()} threads. ms per layer "
        f"(GB/s of K/V), median of {args.rounds} interleaved rounds. \"If overlapped\": "
        "max(read cold, kernel warm); \"if added\": their sum.",
        "",
        "| dtype | K/V per layer | read cold | read warm | kernel cold | kernel warm "
        "| if overlapped | if added |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ])
    print(body)
    if not args.no_write:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from doc_sections import write_section

        write_section(REPO / "docs" / "benchmarks.md", "bench_decode_memory", body)


if __name__ == "__main__":
    main()
