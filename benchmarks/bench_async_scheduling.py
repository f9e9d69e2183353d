"""Asynchronous scheduling vs synchronous steps, interleaved in one process.

Two engines on one checkpoint, one with ``async_scheduling=True`` (step N+1 scheduled and
submitted to the model thread before step N's output is processed), one without. Each
repetition runs the same fresh prompts through both, in alternating order, and the figure
is the ratio of their output tokens per second (async / sync): above 1 is a gain.

Models: the built-in tiny demo model (a step is ~1-3 ms, so Python around the model is a
large share: where overlapping it can show) and, when present, the peers' 0.27B Qwen3
checkpoint (a step is tens to hundreds of ms).

Also the tiny model with every request under a regex grammar (masks computed while the
forward pass runs) and over 2 tensor-parallel ranks (worker processes; the core sends step
N+1 before it reads step N's answers).

    .venv/bin/python benchmarks/bench_async_scheduling.py [--reps 5] [--no-write]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from doc_sections import write_section

from openinfer import LLM, SamplingParams
from openinfer.demo import build_demo_model
from openinfer.structured.params import StructuredOutputsParams

REPO = Path(__file__).resolve().parent.parent
PEERS_MODEL = Path("/root/.cache/openinfer-peers/models/qwen3-0.4b-random-fp32")


def _prompts(batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(prompt_len)] for _ in range(batch)]


GRAMMAR = StructuredOutputsParams(regex="[a-z]+( [a-z]+){0,200}")
"""The constrained workload's grammar: words, long enough for every output length here."""


def _tokens_per_s(llm: LLM, prompts: list[list[int]], max_tokens: int,
                  grammar: bool = False) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            structured_outputs=GRAMMAR if grammar else None)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall


def measure(model: str, workloads: list[tuple[int, int, int]], reps: int,
            tensor_parallel_size: int = 1, grammar: bool = False) -> list[dict]:
    engines = {mode: LLM(model, progress=False, enable_prefix_caching=False,
                         async_scheduling=mode == "async",
                         tensor_parallel_size=tensor_parallel_size)
               for mode in ("sync", "async")}
    rows = []
    for batch, prompt_len, max_tokens in workloads:
        for llm in engines.values():  # warm-up
            _tokens_per_s(llm, _prompts(batch, prompt_len, 0), 4, grammar)
        runs: dict[str, list[float]] = {"sync": [], "async": []}
        for rep in range(reps):
            prompts = _prompts(batch, prompt_len, rep + 1)
            order = ("sync", "async") if rep % 2 == 0 else ("async", "sync")
            for mode in order:
                runs[mode].append(_tokens_per_s(engines[mode], prompts, max_tokens, grammar))
        ratios = [a / s for a, s in zip(runs["async"], runs["sync"])]
        rows.append(dict(batch=batch, prompt_len=prompt_len, max_tokens=max_tokens,
                         sync=statistics.median(runs["sync"]),
                         async_=statistics.median(runs["async"]),
                         ratio=statistics.median(ratios), low=min(ratios), high=max(ratios)))
        print(rows[-1], flush=True)
    for llm in engines.values():
        llm.engine.core.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    tables = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = str(build_demo_model(Path(tmp) / "tiny"))
        demo = "demo tiny (4 layers, hidden 256)"
        models = [(demo, tiny, [(1, 64, 128), (8, 64, 64), (32, 64, 64)], {}),
                  (f"{demo}, every request under a regex grammar", tiny,
                   [(8, 64, 64), (32, 64, 64)], {"grammar": True}),
                  (f"{demo}, 2 tensor-parallel ranks", tiny, [(8, 64, 64), (32, 64, 64)],
                   {"tensor_parallel_size": 2})]
        if PEERS_MODEL.exists():
            models.append((f"peers `{PEERS_MODEL.name}` (0.27B, float32)", str(PEERS_MODEL),
                           [(1, 128, 32), (32, 128, 32)], {}))
        for name, path, workloads, options in models:
            rows = measure(path, workloads, args.reps, **options)
            tables.append((name, rows))
    lines = [
        "## Asynchronous scheduling (benchmarks/bench_async_scheduling.py)",
        "",
        f"Offline `LLM.generate`, greedy, `ignore_eos`; two engines in one process, "
        f"`async_scheduling` on and off, the same fresh prompts through both in alternating "
        f"order, {args.reps} repetitions; {torch.get_num_threads()} torch threads. Ratio = "
        "async / sync output tokens per second (median of the repetitions' ratios, their "
        "range in brackets).",
        "",
        "| model | batch × prompt → output | sync tok/s | async tok/s | ratio |",
        "|---|---|---|---|---|",
    ]
    for name, rows in tables:
        for r in rows:
            lines.append(f"| {name} | {r['batch']} × {r['prompt_len']} → {r['max_tokens']} | "
                         f"{r['sync']:.1f} | {r['async_']:.1f} | **{r['ratio']:.3f}** "
                         f"({r['low']:.3f}–{r['high']:.3f}) |")
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", "bench_async_scheduling", body)


if __name__ == "__main__":
    main()
