"""Decode steps with a Llama-family model's layers in one C++ call per step against the
Python layers (the same kernels, one call each), in one process, interleaved.

The engine runs batch-B decodes after B 256-token prompts; rounds alternate the two ways
(the stack's ``cpu_layers`` entry set, or None), each round one untimed step and then
``--steps`` timed ones, so context growth and host noise fall on both alike. Speedup =
Python layers / one call, per round: median [min, max].

    .venv/bin/python benchmarks/bench_layer_calls.py [--model DIR] [--batch 1 --batch 32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_step_overhead import given_or_peers_models
from doc_sections import write_section

from openinfer import LLM, SamplingParams

REPO = Path(__file__).resolve().parent.parent


def measure(model: str, batch: int, rounds: int, steps: int) -> tuple[str, list[float], list[float]]:
    llm = LLM(model, max_model_len=2048, seed=0, max_num_seqs=max(batch, 1), progress=False,
              enable_prefix_caching=False)
    engine = llm.engine
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=2000, min_tokens=2000, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(100, 30000) for _ in range(256)], params)
    for _ in range(4):
        engine.step()  # prefills, first decodes
    stack = engine.core.executor.worker.model.model
    dtype = engine.core.executor.worker.config.model.dtype
    one_call = stack.cpu_layers.get(dtype)
    if one_call is None or not one_call.covers(batch):
        sys.exit(f"{model}: the one call does not cover batch {batch} here (see models/llama_cpu.py)")
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for use in (True, False):
            stack.cpu_layers[dtype] = one_call if use else None
            engine.step()
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            times[use].append((time.perf_counter() - start) / steps)
    return str(dtype).removeprefix("torch."), times[True], times[False]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="checkpoints (default: the peers' bf16 and fp32)")
    parser.add_argument("--batch", type=int, action="append", help="batch sizes (default: 1 and 32)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    models = given_or_peers_models(args.model)
    rows = []
    for model in models:
        for batch in args.batch or [1, 32]:
            dtype, one, python = measure(model, batch, args.rounds, args.steps)
            speedups = sorted(p / o for o, p in zip(one, python))
            rows.append(f"| `{Path(model).name}` | {dtype} | {batch} | "
                        f"{statistics.median(python) * 1e3:.1f} | {statistics.median(one) * 1e3:.1f} | "
                        f"**{statistics.median(speedups):.2f}x** "
                        f"[{speedups[0]:.2f}, {speedups[-1]:.2f}] |")
            print(rows[-1], flush=True)
    body = "\n".join([
        "## Decode steps: decoder layers in one C++ call (benchmarks/bench_layer_calls.py)",
        "",
        f"Batch-B decode after 256-token prompts, {torch.get_num_threads()} threads; {args.rounds} "
        f"rounds alternating the Python layers and the one call (`models/llama_cpu.py`) in one "
        f"process, {args.steps} timed steps each. Speedup per round: median [min, max].",
        "",
        "| model | dtype | batch | Python layers, ms per step | one call, ms per step | speedup |",
        "|---|---|---|---|---|---|",
        *rows,
    ])
    print(body)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", "bench_layer_calls", body)


if __name__ == "__main__":
    main()
