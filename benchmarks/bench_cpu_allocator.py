"""The caching CPU allocator (openinfer/cpu_allocator.py) on against off, in one process.

One engine per checkpoint; rounds alternate the allocator's limit between its default
("kept") and 0 ("off": every freed block goes back to the C library, as with torch's own
allocator), the order flipping each round. A round runs, in each setting:

- W1's shape: 32 prompts of 256 tokens -> 32 tokens each, step by step. With a budget of 4096
  tokens a step, the first two steps prefill 16 prompts each (the second also decodes the first
  16); the rest are batch-32 decode steps. Reported: the two prefill steps, and the decode steps.
- W2's first token: one 512-token prompt -> 1 token.

Prompts are fresh random token ids (prefix caching off). Speedup = off / kept, per round:
median [min, max].

    .venv/bin/python benchmarks/bench_cpu_allocator.py [--model DIR] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
from bench_step_overhead import given_or_peers_models
from doc_sections import write_section

from openinfer import LLM, SamplingParams, cpu_allocator
from openinfer.kernels.cpu_attention import load_cpu_attention

REPO = Path(__file__).resolve().parent.parent
rng = random.Random(0)


def steps(llm: LLM, prompts: int, length: int, new_tokens: int) -> list[float]:
    """Seconds of each engine step that serves ``prompts`` fresh prompts of ``length`` tokens."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens,
                            ignore_eos=True)
    for _ in range(prompts):
        engine.add_request(f"r{rng.random()}", [rng.randrange(100, 30000) for _ in range(length)],
                           params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="checkpoints (default: the peers' bf16 and fp32)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    kernels = load_cpu_attention()
    if kernels is None:
        raise SystemExit("the CPU kernel extension cannot be built here")
    kept_limit = cpu_allocator.cache_limit()
    limits = {"kept": kept_limit, "off": 0}
    cases = ("W1 prefill steps (2 x 4096 tokens)", "W1 decode steps (batch 32)", "W2 first token (512)")
    rows = []
    for model in given_or_peers_models(args.model):
        llm = LLM(model, max_model_len=2048, seed=0, max_num_seqs=32, max_num_batched_tokens=4096,
                  enable_prefix_caching=False, progress=False)
        dtype = str(llm.engine.core.executor.worker.config.model.dtype).removeprefix("torch.")
        steps(llm, 32, 256, 2)  # the first calls of the process (thread pools, plans' first sight)
        times: dict[str, dict[str, list[float]]] = {s: {c: [] for c in cases} for s in limits}
        for r in range(args.rounds):
            order = list(limits) if r % 2 == 0 else list(reversed(limits))
            for setting in order:
                cpu_allocator.install(kernels, limit=limits[setting])
                w1 = steps(llm, 32, 256, 32)
                times[setting][cases[0]].append(sum(w1[:2]))
                times[setting][cases[1]].append(sum(w1[2:]))
                times[setting][cases[2]].append(sum(steps(llm, 1, 512, 1)))
        cpu_allocator.install(kernels, limit=kept_limit)
        for case in cases:
            kept, off = times["kept"][case], times["off"][case]
            speedups = sorted(o / k for k, o in zip(kept, off))
            rows.append(f"| `{Path(model).name}` | {dtype} | {case} | {statistics.median(off) * 1e3:.0f} | "
                        f"{statistics.median(kept) * 1e3:.0f} | **{statistics.median(speedups):.2f}x** "
                        f"[{speedups[0]:.2f}, {speedups[-1]:.2f}] |")
            print(rows[-1], flush=True)
        print(cpu_allocator.stats(kernels))
        del llm
    body = "\n".join([
        "## CPU caching allocator (benchmarks/bench_cpu_allocator.py)",
        "",
        f"{torch.get_num_threads()} threads; one engine per checkpoint, {args.rounds} rounds alternating "
        f"the allocator's limit between its default ({kept_limit >> 20} MiB, `kept`) and 0 (`off`: freed "
        f"blocks go back to the C library, as with torch's allocator). W1's shape: 32 x 256-token prompts "
        f"-> 32 tokens, a budget of 4096 tokens a step (two prefill steps, then batch-32 decode); W2's "
        f"first token: one 512-token prompt. Fresh random prompts, prefix caching off. Speedup = off / "
        f"kept, per round: median [min, max].",
        "",
        "| model | dtype | steps | off, ms | kept, ms | speedup |",
        "|---|---|---|---|---|---|",
        *rows,
    ])
    print(body)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", "bench_cpu_allocator", body)


if __name__ == "__main__":
    main()
