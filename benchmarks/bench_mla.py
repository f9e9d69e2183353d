"""MLA prefill: one latent-attention layer's step time for a step of prefills, in this tree and
in a baseline tree, interleaved (issue 49 item 3: every prefill of a step in one backend call).

The layer is DeepSeek-V2-Lite's attention (hidden 1024 here, 16 heads, kv_lora_rank 512,
qk_nope 128, qk_rope 64, v 128, no q LoRA), random weights, the `cpu` attention backend and its
bound kernels, a paged latent cache; each step is a batch of fresh prompts (B sequences of L
tokens) or of continuations (L new tokens over C cached ones). Only public interfaces are used
(MLAAttention, build_metadata, plan_gemms, bind_platform), so the same code times both trees.

    .venv/bin/python benchmarks/bench_mla.py --baseline-tree ../wt-old [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHAPES = [(1, 512, 0), (4, 128, 0), (16, 32, 0), (32, 16, 0), (4, 64, 448)]
"""(sequences, new tokens each, cached tokens each) of a step's prefills."""


def time_layer(dtype_name: str, reps: int) -> dict[str, float]:
    """Milliseconds per step of each shape, in the tree on sys.path (a child process)."""
    import time

    import torch

    from openinfer.attention.selector import select_attention_backend
    from openinfer.kernels.cpu_attention import load_cpu_attention
    from openinfer.kernels.custom_op import Platform
    from openinfer.layers.mla import MLAAttention, MLAConfig
    from openinfer.layers.rotary import get_rope
    from openinfer.models.gemm_plans import plan_gemms
    from openinfer.models.platform import bind_platform

    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    mla = MLAConfig(hidden_size=1024, num_heads=16, nope_dim=128, rope_dim=64, v_dim=128,
                    latent_dim=512, q_lora_rank=0, bias=False, scale=192**-0.5)
    layer = MLAAttention(mla, get_rope(64, 4096, 10000.0, None, interleaved=True))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.02)
    layer = layer.to(dtype)
    layer.process_weights_after_loading()
    plan_gemms(layer)  # the GEMM paths the engine would pick on this CPU
    bind_platform(layer, Platform("cpu", load_cpu_attention()))
    backend = select_attention_backend("cpu", "cpu")
    block = 16
    figures = {}
    for seqs, new, cached in SHAPES:
        per_seq = -(-(new + cached) // block)
        cache = torch.zeros(seqs * per_seq, block, 512 + 64, dtype=dtype)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(seqs)]
        meta_args = ([new] * seqs, [new + cached] * seqs, tables, block, "cpu")
        x = torch.randn(seqs * new, 1024, dtype=dtype)
        positions = torch.arange(cached, cached + new).repeat(seqs)
        times = []
        with torch.no_grad():
            for _ in range(reps):
                meta = backend.build_metadata(*meta_args)  # per step, as the runner does
                start = time.perf_counter()
                layer(positions, x, cache, meta)
                times.append(time.perf_counter() - start)
        figures[f"{seqs}x{new}+{cached}"] = 1e3 * statistics.median(times[1:])
    return figures


def run_tree(tree: Path, dtype: str, reps: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{REPO / 'benchmarks'}"}
    code = f"import bench_mla, json; print(json.dumps(bench_mla.time_layer({dtype!r}, {reps})))"
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                         text=True, cwd=tree).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", type=Path, required=True,
                        help="a checkout of the commit to compare with (git worktree add)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    baseline_commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.baseline_tree,
                                     capture_output=True, text=True).stdout.strip()
    rows = []
    for dtype in ("float32", "bfloat16"):
        runs = {"base": [], "new": []}
        for _ in range(args.rounds):  # alternate the trees: the machine's drift hits both
            runs["base"].append(run_tree(args.baseline_tree.resolve(), dtype, args.reps))
            runs["new"].append(run_tree(REPO, dtype, args.reps))
        for shape in runs["new"][0]:
            base = statistics.median(r[shape] for r in runs["base"])
            new = statistics.median(r[shape] for r in runs["new"])
            seqs, rest = shape.split("x")
            tokens, cached = rest.split("+")
            rows.append(f"| {dtype} | {seqs} | {tokens} | {cached} | {base:.2f} | {new:.2f} | "
                        f"**{base / new:.2f}x** |")
            print(rows[-1], flush=True)
    body = "\n".join([
        "## MLA prefill: a step's prefills in one backend call (benchmarks/bench_mla.py)",
        "",
        "One DeepSeek-V2-Lite-shaped MLA layer (16 heads, kv_lora_rank 512, rope 64, nope 128, "
        "v 128), `cpu` backend, 2 threads: the step time of a batch of prefills, median of "
        f"{args.reps - 1} steps, median over {args.rounds} alternating rounds per tree. Baseline: "
        f"`{baseline_commit}` (each prefill alone: its own `kv_b_proj` GEMM and SDPA); this tree: "
        "one `kv_b_proj` GEMM over every prefill's gathered context and one paged-attention call.",
        "",
        "| dtype | sequences | new tokens each | cached tokens each | baseline ms | this tree ms | speedup |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ])
    if not args.no_write:
        from doc_sections import write_section

        write_section(REPO / "docs" / "benchmarks.md", "bench_mla", body)
    print(body)


if __name__ == "__main__":
    main()
