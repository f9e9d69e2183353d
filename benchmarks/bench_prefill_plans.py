"""Prefill with the GEMM plan as chosen (129-1024 rows: paths that build a kernel per row
count need BUILD_MARGIN) against the plan from timing alone (margin 1.0), in one process.

Both engines load the same checkpoint; rounds alternate them (the order flips each round).
A round runs, on each engine, one prompt at each ``--length`` (fresh random token ids, no
prefix cache) twice: the first call at a length the process has not run (the round adds 32 x
its index: a new padded row count) meets oneDNN's primitive builds, the second finds them
made. Then ``--batch`` prompts of 256 tokens in one step (W1's prefill: calls of batch x 256
rows). Speedup = timing alone / as chosen, per round: median [min, max].

    .venv/bin/python benchmarks/bench_prefill_plans.py [--model DIR] [--rounds 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from pathlib import Path

import torch
from bench_step_overhead import given_or_peers_models
from doc_sections import write_section

from openinfer import LLM, SamplingParams
from openinfer.kernels import gemm_plan
from openinfer.models.gemm_plans import describe_gemms

REPO = Path(__file__).resolve().parent.parent
rng = random.Random(0)


def load(model: str, build_margin: float, max_tokens: int) -> LLM:
    chosen = gemm_plan.BUCKETS
    gemm_plan.BUCKETS = tuple(dataclasses.replace(b, build_margin=build_margin) if b.build_margin != 1.0
                         else b for b in chosen)
    try:
        llm = LLM(model, max_model_len=4096, seed=0, max_num_seqs=64, progress=False,
                  enable_prefix_caching=False, max_num_batched_tokens=max_tokens)
    finally:
        gemm_plan.BUCKETS = chosen
    print(f"margin {build_margin}: {describe_gemms(llm.engine.core.executor.worker.model).text}")
    return llm


def prefill(llm: LLM, lengths: list[int]) -> float:
    """Seconds for one step that prefills prompts of ``lengths`` and samples their first token."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for length in lengths:
        engine.add_request(f"r{rng.random()}", [rng.randrange(100, 30000) for _ in range(length)],
                           params)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="checkpoints (default: the peers' bf16 and fp32)")
    parser.add_argument("--length", type=int, action="append", help="prompt lengths (default: 256 512 768)")
    parser.add_argument("--batch", type=int, default=16, help="prompts of 256 tokens in one step")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    lengths = args.length or [256, 512, 768]
    rows = []
    for model in given_or_peers_models(args.model):
        engines = {"as chosen": load(model, gemm_plan.BUILD_MARGIN, args.batch * 256),
                   "timing alone": load(model, 1.0, args.batch * 256)}
        for llm in engines.values():
            prefill(llm, [64] * 2)  # first calls of the process (allocations, thread pools)
            # Above 1024 rows both run the same paths, and oneDNN's primitive cache is the
            # process's: build them here, not in whichever engine a round runs first.
            prefill(llm, [256] * args.batch)
        cases = [f"{n} tokens, {kind}" for n in lengths for kind in ("first", "again")]
        cases.append(f"{args.batch} x 256 tokens")
        times: dict[str, dict[str, list[float]]] = {e: {c: [] for c in cases} for e in engines}
        for r in range(args.rounds):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for n in lengths:
                length = n + 32 * r  # a padded row count this process has not run
                for name in order:
                    times[name][f"{n} tokens, first"].append(prefill(engines[name], [length]))
                    times[name][f"{n} tokens, again"].append(prefill(engines[name], [length]))
            for name in order:
                times[name][cases[-1]].append(prefill(engines[name], [256] * args.batch))
        dtype = str(engines["as chosen"].engine.core.executor.worker.config.model.dtype)
        for case in cases:
            chosen, alone = times["as chosen"][case], times["timing alone"][case]
            speedups = sorted(a / c for c, a in zip(chosen, alone))
            rows.append(f"| `{Path(model).name}` | {dtype.removeprefix('torch.')} | {case} | "
                        f"{statistics.median(alone) * 1e3:.0f} | {statistics.median(chosen) * 1e3:.0f} | "
                        f"**{statistics.median(speedups):.2f}x** [{speedups[0]:.2f}, {speedups[-1]:.2f}] |")
            print(rows[-1], flush=True)
        del engines
    body = "\n".join([
        "## Prefill: the build margin for 129-1024 rows (benchmarks/bench_prefill_plans.py)",
        "",
        f"{torch.get_num_threads()} threads; two engines in one process, one planned as chosen "
        f"(in 129-1024 rows a path that builds a kernel per row count must be "
        f"{gemm_plan.BUILD_MARGIN}x faster as timed), one from timing alone; {args.rounds} rounds "
        f"alternating them. `first`: a prompt length the process has not run (the round adds "
        f"32 x its index to the length); `again`: the same length next. Speedup = timing alone / as "
        f"chosen, per round: median [min, max].",
        "",
        "| model | dtype | prefill | timing alone, ms | as chosen, ms | speedup |",
        "|---|---|---|---|---|---|",
        *rows,
    ])
    print(body)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", "bench_prefill_plans", body)


if __name__ == "__main__":
    main()
