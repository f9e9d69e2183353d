"""Mixture-of-experts and MLA figures (issue: DeepSeek-V2/V3 family).

1. An MoE layer's step time vs a dense gated MLP with the same active parameters, at 1, 32
   and 512 tokens, interleaved in one process: openinfer.layers.moe.MoE (64 routed experts of
   256, top-6, one shared expert, DeepSeek-V3's routing) vs GatedMLP(hidden, 7 x 256).
2. KV bytes per token and the tokens one --kv-cache-memory holds: DeepSeek-V3's MLA latent
   spec vs GQA and MHA specs of the same model width (from the specs, no timing).

    .venv/bin/python benchmarks/bench_moe.py [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from doc_sections import write_section

from openinfer.kv.spec import FullAttentionSpec, MLALatentSpec
from openinfer.layers.mlp import GatedMLP
from openinfer.layers.moe import MoE, RoutingConfig

REPO = Path(__file__).resolve().parent.parent
HIDDEN, EXPERT_INTER, EXPERTS, TOP_K, SHARED = 1024, 256, 64, 6, 1


def seconds(fn, min_seconds: float = 0.3) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        if time.perf_counter() - start >= min_seconds:
            return (time.perf_counter() - start) / calls


def layer_figures(rounds: int) -> list[str]:
    torch.manual_seed(0)
    routing = RoutingConfig(num_experts=EXPERTS, top_k=TOP_K, scoring="sigmoid", method="noaux_tc",
                            num_groups=8, topk_groups=4, renormalize=True, scaling=2.5,
                            fp32_logits=True)
    moe = MoE(HIDDEN, EXPERT_INTER, routing, GatedMLP(HIDDEN, EXPERT_INTER * SHARED))
    dense = GatedMLP(HIDDEN, EXPERT_INTER * (TOP_K + SHARED))
    with torch.no_grad():
        for p in [*moe.parameters(), *dense.parameters()]:
            p.normal_(std=0.02)
    rows = ["| tokens | MoE ms | dense ms (same active params) | MoE / dense | experts hit |",
            "|---|---|---|---|---|"]
    with torch.inference_mode():
        for tokens in (1, 32, 512):
            x = torch.randn(tokens, HIDDEN)
            m, d = [], []
            for _ in range(rounds):
                m.append(seconds(lambda x=x: moe(x)))
                d.append(seconds(lambda x=x: dense(x)))
            hit = int(torch.unique(moe.gate(x)[1]).numel())
            ratio = statistics.median(a / b for a, b in zip(m, d))
            rows.append(f"| {tokens} | {statistics.median(m) * 1e3:.3f} | {statistics.median(d) * 1e3:.3f} | "
                        f"{ratio:.2f}x | {hit} of {EXPERTS} |")
            print(rows[-1], flush=True)
    return rows


def kv_figures(memory_gib: float = 4.0) -> list[str]:
    """DeepSeek-V3: 61 layers, 128 heads, q/k head 192 (128 + 64 rope), v head 128, kv_lora 512."""
    layers, dtype, block = 61, "bfloat16", 16
    specs = {
        "MLA latent (kv_lora_rank 512 + rope 64)": MLALatentSpec(block, 512, 64, dtype),
        "GQA, 8 KV heads of 128": FullAttentionSpec(block, 8, 128, dtype),
        "MHA, 128 KV heads of 192 (V padded to K's 192)": FullAttentionSpec(block, 128, 192, dtype),
    }
    rows = [f"| cache (bf16, {layers} layers) | bytes per token | tokens in {memory_gib:g} GiB | vs MLA |",
            "|---|---|---|---|"]
    mla = specs["MLA latent (kv_lora_rank 512 + rope 64)"].bytes_per_block * layers / block
    for name, spec in specs.items():
        per_token = spec.bytes_per_block * layers / block
        tokens = int(memory_gib * 2**30 // (spec.bytes_per_block * layers)) * block
        rows.append(f"| {name} | {per_token:,.0f} | {tokens:,} | {per_token / mla:.1f}x the bytes |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    layer = layer_figures(args.rounds)
    kv = kv_figures()
    body = "\n".join([
        "## Mixture of experts and MLA (benchmarks/bench_moe.py)",
        "",
        f"MoE layer vs a dense gated MLP with the same active parameters: hidden {HIDDEN}, "
        f"{EXPERTS} routed experts of {EXPERT_INTER} (top-{TOP_K}, noaux_tc routing) + {SHARED} "
        f"shared, against GatedMLP({HIDDEN}, {EXPERT_INTER * (TOP_K + SHARED)}); float32, "
        f"{torch.get_num_threads()} threads, median of {args.rounds} interleaved rounds.",
        "",
        *layer,
        "",
        "KV cache per token, DeepSeek-V3's geometry (from the specs):",
        "",
        *kv,
    ])
    print(body)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", "bench_moe", body)


if __name__ == "__main__":
    main()
