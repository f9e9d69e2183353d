"""Prefill context parallelism: time to first token of one long prompt at CP=2 against
CP=1, and what the ranks exchange, in one run.

Two engines on one checkpoint (``prefill_context_parallel_size`` 1 and 2); fresh prompts
of each length through both in alternating order, one output token each (the prompt is
one chunk: ``max_num_batched_tokens`` is the longest prompt). On a CPU the ranks share
its cores: each of the two ranks runs one torch thread, the single rank as many as there
are cores, so the ratio weighs the zig-zag split (half the tokens per rank, plus one K/V
all-gather per layer and one all-reduce of the hidden states) against one process whose
GEMMs and attention are split over threads. On GPUs (``--device cuda``, one per rank) the
same script times the usual case.

    .venv/bin/python benchmarks/bench_context_parallel.py [--device cpu] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from doc_sections import write_section

from openinfer import LLM, SamplingParams
from openinfer.demo import DemoModelSpec, build_demo_model

REPO = Path(__file__).resolve().parent.parent
LENGTHS = (256, 1024, 2048)


def _prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 4000, (length,), generator=g).tolist()


def _ttft(llm: LLM, prompt: list[int]) -> tuple[float, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    return time.perf_counter() - start, out.outputs[0].token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_demo_model(Path(tmp) / "demo", DemoModelSpec(
            hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64)))
        engines = {cp: LLM(model, progress=False, device=args.device, enable_prefix_caching=False,
                           max_num_batched_tokens=max(LENGTHS), max_model_len=max(LENGTHS) + 16,
                           prefill_context_parallel_size=cp) for cp in (1, 2)}
        for llm in engines.values():  # warm-up
            _ttft(llm, _prompt(64, 0))
        rows = []
        for length in LENGTHS:
            times: dict[int, list[float]] = {1: [], 2: []}
            before = engines[2].engine.core.executor.call("collective_stats")
            for rep in range(args.reps):
                prompt = _prompt(length, rep + 1)
                tokens = {}
                for cp in ((1, 2) if rep % 2 == 0 else (2, 1)):
                    seconds, tokens[cp] = _ttft(engines[cp], prompt)
                    times[cp].append(seconds)
                assert tokens[1] == tokens[2], "CP=2 gave another first token than CP=1"
            after = engines[2].engine.core.executor.call("collective_stats")
            moved = {k: (after[k][1] - before[k][1]) / args.reps for k in after}
            ratios = [b / a for a, b in zip(times[1], times[2])]
            rows.append(dict(length=length, cp1=statistics.median(times[1]),
                             cp2=statistics.median(times[2]), ratio=statistics.median(ratios),
                             low=min(ratios), high=max(ratios), moved=moved))
            print(rows[-1], flush=True)
        for llm in engines.values():
            llm.engine.core.shutdown()
    lines = [
        "## Prefill context parallelism (benchmarks/bench_context_parallel.py)",
        "",
        f"Demo model (hidden 512, 8 layers, 8 heads, 4 KV heads) on {args.device}; one prompt "
        f"at a time, one output token, {args.reps} repetitions in alternating order; the "
        "first token checked equal. On a CPU the ranks share its cores: one torch thread per "
        "rank at CP=2, one per core at CP=1.",
        "",
        "| prompt tokens | CP=1 TTFT | CP=2 TTFT | CP=2 / CP=1 | K/V all-gathered per prefill "
        "(rank 0's payload) | hidden all-reduced |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['length']} | {1e3 * r['cp1']:.0f} ms | {1e3 * r['cp2']:.0f} ms | "
                     f"**{r['ratio']:.2f}** ({r['low']:.2f}–{r['high']:.2f}) | "
                     f"{r['moved']['all_gather'] / 2**20:.1f} MiB | "
                     f"{r['moved']['all_reduce'] / 2**20:.1f} MiB |")
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", "bench_context_parallel", body)


if __name__ == "__main__":
    main()
