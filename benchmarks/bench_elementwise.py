"""The C++ elementwise kernels (RMSNorm in bfloat16, rotary embedding, the gated MLP's
SiLU-and-multiply) against torch's composites, inside one engine, interleaved.

One ``openinfer.LLM`` on the peers' model; each round runs every workload once with the
kernels switched on and once with them off (the modules bound to the CPU platform or not; float32
norms keep their kernel in both: it predates this comparison), in alternating order, so that
the machine's drift hits both alike. Reports per workload the median time with kernels over
the time without (below 1: the kernels are faster) and its range over rounds.

    W2 decode   one 512-token prompt, then 128 tokens (batch-1 decode dominates)
    W1          32 prompts x 256 tokens -> 32 tokens each (prefill-heavy, then batch-32 decode)
    W3          32 prompts sharing a 1024-token prefix + 64 own tokens -> 16 tokens each

    .venv/bin/python benchmarks/bench_elementwise.py [--dtype bfloat16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
PEERS_MODELS = Path("/root/.cache/openinfer-peers/models")


def workloads(seed: int) -> dict[str, tuple[list[list[int]], int]]:
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 30000) for _ in range(n)]

    prefix = ids(1024)
    return {"W2 decode": ([ids(512)], 128), "W1": ([ids(256) for _ in range(32)], 32),
            "W3": ([prefix + ids(64) for _ in range(32)], 16)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--model", help="default: the peers' model of that dtype")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output", type=Path, help="write the table as this file's section")
    args = ap.parse_args()
    model = args.model or str(PEERS_MODELS / ("qwen3-0.4b-random" if args.dtype == "bfloat16"
                                             else "qwen3-0.4b-random-fp32"))
    from openinfer import LLM, SamplingParams
    from openinfer.cpu_features import cpu_capability, cpu_model_name
    from openinfer.kernels.custom_op import Platform
    from openinfer.layers.mlp import GatedMLP
    from openinfer.layers.norm import RMSNorm
    from openinfer.layers.rotary import RotaryEmbedding

    llm = LLM(model, dtype=args.dtype, max_model_len=2048, seed=0, max_num_seqs=32,
              max_num_batched_tokens=4096, kv_cache_memory=4 << 30, progress=False)
    net = llm.engine.core.executor.worker.model
    kernels = next(m.cpu_kernels for m in net.modules() if isinstance(m, GatedMLP))
    if kernels is None:
        sys.exit("the engine runs without the CPU kernels (attention backend not cpu)")
    switched = [m for m in net.modules() if isinstance(m, (GatedMLP, RotaryEmbedding))
                or (isinstance(m, RMSNorm) and m.weight.dtype != torch.float32)]

    def run(prompts: list[list[int]], out: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=out, min_tokens=out, ignore_eos=True)
        llm.engine.core.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return time.perf_counter() - start

    run(*workloads(0)["W2 decode"])  # warm up both paths
    ratios: dict[str, list[float]] = {name: [] for name in workloads(0)}
    for r in range(args.rounds):
        for name, (prompts, out) in workloads(r + 1).items():
            times = {}
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                for m in switched:
                    m.bind(Platform("cpu", kernels if on else None))
                times[on] = run(prompts, out)
            ratios[name].append(times[True] / times[False])
            print(f"round {r} {name}: kernels {times[True]:.2f} s, torch {times[False]:.2f} s",
                  flush=True)
    rows = [f"| {name} | {statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f}) |"
            for name, v in ratios.items()]
    body = "\n".join([
        f"## C++ elementwise kernels vs torch, {args.dtype} (benchmarks/bench_elementwise.py)",
        "",
        f"{args.dtype}, the peers' 0.27B Qwen3, one engine, kernels on and off interleaved over "
        f"{args.rounds} rounds ({cpu_model_name()}, {cpu_capability()}, "
        f"{torch.get_num_threads()} threads). Time with the kernels over time without (median, "
        "range); the switched kernels are SiLU-and-multiply, rotary and bf16 RMSNorm (float32 "
        "norms use theirs in both runs).",
        "",
        "| workload | time ratio |",
        "|---|---|",
        *rows,
    ])
    print(body)
    if args.output is not None:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from doc_sections import write_section

        write_section(args.output, f"bench_elementwise_{args.dtype}", body)


if __name__ == "__main__":
    main()
