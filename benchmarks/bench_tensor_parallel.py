"""Tensor parallelism: weight memory per rank, bytes each collective moves per step, and
step throughput at TP=2 against TP=1, in one run.

Two engines on one checkpoint (``tensor_parallel_size`` 1 and 2), the same fresh prompts
through both in alternating order. On a CPU the ranks share its cores: each of the two
ranks runs one torch thread, the single rank runs as many as there are cores, so the ratio
weighs two processes with half a GEMM each (plus the collectives) against one process
whose GEMMs are split over threads. On GPUs (``--device cuda``, one GPU per rank) the same
script times the usual case.

    .venv/bin/python benchmarks/bench_tensor_parallel.py [--model DIR] [--device cpu] [--reps 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from doc_sections import write_section

from openinfer import LLM, SamplingParams
from openinfer.demo import DemoModelSpec, build_demo_model

REPO = Path(__file__).resolve().parent.parent
PEERS_MODEL = Path("/root/.cache/openinfer-peers/models/qwen3-0.4b-random-fp32")


def _prompts(batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(prompt_len)] for _ in range(batch)]


def _decode(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Output tokens per second, and the tokens."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, tokens)) / wall, tokens


def _collectives(llm: LLM) -> dict[str, list[int]]:
    return llm.engine.core.executor.call("collective_stats")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(PEERS_MODEL) if PEERS_MODEL.exists() else None,
                        help="checkpoint (default: the peers' 0.27B Qwen3, else a demo model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(build_demo_model(Path(tmp) / "demo", DemoModelSpec(
            hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64)))
        engines = {tp: LLM(model, progress=False, device=args.device, enable_prefix_caching=False,
                           tensor_parallel_size=tp) for tp in (1, 2)}
        whole = engines[1].engine.core.executor.call("weight_bytes")
        per_rank = engines[2].engine.core.executor.collective_rpc("weight_bytes")
        rows = []
        for batch, prompt_len, max_tokens in ((1, 128, 32), (16, 128, 32)):
            for llm in engines.values():  # warm-up
                _decode(llm, _prompts(batch, 16, 0), 2)
            runs: dict[int, list[float]] = {1: [], 2: []}
            for rep in range(args.reps):
                prompts = _prompts(batch, prompt_len, rep + 1)
                outputs = {}
                for tp in ((1, 2) if rep % 2 == 0 else (2, 1)):
                    rate, outputs[tp] = _decode(engines[tp], prompts, max_tokens)
                    runs[tp].append(rate)
                assert outputs[1] == outputs[2], "TP=2 gave other tokens than TP=1"
            # One more decode-only measurement of the collectives: a prefill of 1 token per
            # sequence, then max_tokens steps; their calls and bytes per step.
            before = _collectives(engines[2])
            _decode(engines[2], _prompts(batch, 1, 99), max_tokens)
            after = _collectives(engines[2])
            per_step = {name: ((after[name][0] - before[name][0]) / max_tokens,
                               (after[name][1] - before[name][1]) / max_tokens)
                        for name in after}
            ratios = [b / a for a, b in zip(runs[1], runs[2])]
            rows.append(dict(batch=batch, prompt_len=prompt_len, max_tokens=max_tokens,
                             tp1=statistics.median(runs[1]), tp2=statistics.median(runs[2]),
                             ratio=statistics.median(ratios), low=min(ratios),
                             high=max(ratios), per_step=per_step))
            print(rows[-1], flush=True)
        for llm in engines.values():
            llm.engine.core.shutdown()
    name = Path(model).name if args.model else "demo (hidden 512, 8 layers, 8 heads)"
    lines = [
        "## Tensor parallelism (benchmarks/bench_tensor_parallel.py)",
        "",
        f"Model `{name}` on {args.device}; TP=1 and TP=2 engines in one process, the same fresh "
        f"prompts through both in alternating order, {args.reps} repetitions; greedy tokens "
        "checked equal. On a CPU the ranks share its cores: one torch thread per rank at "
        "TP=2, one per core at TP=1.",
        "",
        f"Weights: TP=1 **{whole / 2**20:.1f} MiB**; TP=2 per rank "
        + ", ".join(f"**{b / 2**20:.1f} MiB** ({b / whole:.2f}x)" for b in per_rank)
        + " (norms replicated, everything else split).",
        "",
        "| batch × prompt → output | TP=1 tok/s | TP=2 tok/s | TP=2 / TP=1 | all-reduce per "
        "decode step | all-gather per decode step |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ar_calls, ar_bytes = r["per_step"]["all_reduce"]
        ag_calls, ag_bytes = r["per_step"]["all_gather"]
        lines.append(
            f"| {r['batch']} × {r['prompt_len']} → {r['max_tokens']} | {r['tp1']:.1f} | "
            f"{r['tp2']:.1f} | **{r['ratio']:.2f}** ({r['low']:.2f}–{r['high']:.2f}) | "
            f"{ar_calls:.0f} calls, {ar_bytes / 1024:.0f} KiB | "
            f"{ag_calls:.0f} calls, {ag_bytes / 1024:.0f} KiB |")
    lines += ["", "Bytes are each rank's payload (the tensor it reduces or gathers); a ring "
              "all-reduce over p ranks sends 2(p-1)/p of it per rank."]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", "bench_tensor_parallel", body)


if __name__ == "__main__":
    main()
