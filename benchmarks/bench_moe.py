"""Mixture-of-experts and MLA figures (issue: DeepSeek-V2/V3 family).

1. An MoE layer's step time at 1, 32 and 512 tokens, float32 and bfloat16, interleaved in one
   process: openinfer.layers.moe.MoE (64 routed experts of 256, top-6, one shared expert,
   DeepSeek-V3's routing) with its experts in the fused C++ kernel (the cpu backend's path),
   the same layer with the experts' Python loop (the torch path, few-row experts through the
   C++ GEMM: the cpu backend's path before the fused kernel), and a dense GatedMLP(hidden,
   7 x 256) with the same active parameters.
2. KV bytes per token and the tokens one --kv-cache-memory holds: DeepSeek-V3's MLA latent
   spec vs GQA and MHA specs of the same model width (from the specs, no timing).
3. End to end: offline greedy generation of a small random DeepSeek-V3 (built here with
   transformers) by openinfer's LLM and by transformers' generate, same prompts, same run.

    .venv/bin/python benchmarks/bench_moe.py [--no-write]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from pathlib import Path

import torch
from doc_sections import write_section

from openinfer.kernels.cpu_attention import load_cpu_attention
from openinfer.kernels.custom_op import CustomOp, Platform
from openinfer.kv.spec import FullAttentionSpec, MLALatentSpec
from openinfer.layers.mlp import GatedMLP
from openinfer.layers.moe import FusedExperts, MoE
from openinfer.layers.moe_router import RoutingConfig
from openinfer.models.gemm_plans import plan_gemms
from openinfer.models.platform import bind_platform

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


def layer_figures(rounds: int, dtype: torch.dtype) -> list[str]:
    torch.manual_seed(0)
    routing = RoutingConfig(num_experts=EXPERTS, top_k=TOP_K, scoring="sigmoid", method="noaux_tc",
                            num_groups=8, topk_groups=4, renormalize=True, scaling=2.5,
                            fp32_logits=True)
    fused = MoE(HIDDEN, EXPERT_INTER, routing, GatedMLP(HIDDEN, EXPERT_INTER * SHARED))
    dense = GatedMLP(HIDDEN, EXPERT_INTER * (TOP_K + SHARED))
    with torch.no_grad():
        for p in [*fused.parameters(), *dense.parameters()]:
            p.normal_(std=0.02)
    fused, dense = fused.to(dtype), dense.to(dtype)
    fused.gate.float()  # DeepSeek's router stays float32 (fp32_logits)
    loop = copy.deepcopy(fused)
    # As an engine on the cpu backend runs them: GEMM plans for the linear layers, the
    # extension's kernels; `loop` keeps its experts' Python loop (its few-row expert GEMMs
    # still through the C++ GEMM, as before the fused kernel).
    kernels = load_cpu_attention()
    platform = Platform("cpu", kernels)
    for model in (fused, loop, dense):
        plan_gemms(model)
    bind_platform(fused, platform)
    bind_platform(dense, platform)
    for op in loop.modules():
        if isinstance(op, CustomOp) and not isinstance(op, FusedExperts):
            op.bind(platform)
    name = str(dtype).removeprefix("torch.")
    rows = []
    with torch.inference_mode():
        for tokens in (1, 32, 512):
            x = torch.randn(tokens, HIDDEN).to(dtype)
            times = {"fused": [], "loop": [], "dense": []}
            for _ in range(rounds):
                for label, model in (("fused", fused), ("loop", loop), ("dense", dense)):
                    times[label].append(seconds(lambda m=model, x=x: m(x)))
            hit = int(torch.unique(fused.gate(x)[1]).numel())
            f, lp, d = (statistics.median(times[k]) for k in ("fused", "loop", "dense"))
            rows.append(f"| {name} | {tokens} | {f * 1e3:.3f} | {lp * 1e3:.3f} | {d * 1e3:.3f} | "
                        f"{_ratio(times['loop'], times['fused']):.2f}x | "
                        f"{_ratio(times['fused'], times['dense']):.2f}x | "
                        f"{hit} of {EXPERTS} |")
            print(rows[-1], flush=True)
    return rows


def _ratio(a: list[float], b: list[float]) -> float:
    """The median of the rounds' ratios (each round timed both side by side)."""
    return statistics.median(p / q for p, q in zip(a, b))


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


E2E_CONFIG = dict(
    vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=128, q_lora_rank=192,
    qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, n_routed_experts=16,
    num_experts_per_tok=4, moe_intermediate_size=256, n_shared_experts=1, first_k_dense_replace=1,
    n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
    max_position_embeddings=2048, initializer_range=0.05)


def e2e_figures(batch: int = 16, prompt_len: int = 128, new_tokens: int = 32) -> list[str]:
    import tempfile

    import transformers

    from openinfer import LLM, SamplingParams

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**E2E_CONFIG)
    config.architectures = ["DeepseekV3ForCausalLM"]
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    params = sum(p.numel() for p in hf.parameters())
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(10, E2E_CONFIG["vocab_size"], (batch, prompt_len), generator=g)
    rows = ["| engine | wall s | output tokens/s | total tokens/s |", "|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as path:
        hf.save_pretrained(path)
        llm = LLM(path, progress=False, enable_prefix_caching=False, skip_tokenizer_init=True)
        sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        llm.generate(prompts[:2, :16].tolist(), sp)  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts.tolist(), sp)
        ours = time.perf_counter() - start
        with torch.inference_mode():
            hf.generate(prompts[:2, :16], max_new_tokens=4, do_sample=False)
            start = time.perf_counter()
            ref = hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens)
            theirs = time.perf_counter() - start
    same = sum(o.outputs[0].token_ids == r[prompt_len:].tolist() for o, r in zip(outs, ref))
    for name, wall in (("openinfer", ours), ("transformers", theirs)):
        rows.append(f"| {name} | {wall:.2f} | {batch * new_tokens / wall:.1f} | "
                    f"{batch * (prompt_len + new_tokens) / wall:.1f} |")
    rows.append(f"| openinfer / transformers | | {theirs / ours:.2f}x | {theirs / ours:.2f}x |")
    rows += ["", f"{params / 1e6:.0f}M parameters; {batch} prompts x {prompt_len} tokens -> "
             f"{new_tokens}, greedy; sequences identical to transformers' cached generate: "
             f"{same}/{batch}."]
    print("\n".join(rows), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    layer = [*layer_figures(args.rounds, torch.float32), *layer_figures(args.rounds, torch.bfloat16)]
    load_after = os.getloadavg()[0]
    isa = load_cpu_attention().isa()
    kv = kv_figures()
    e2e = e2e_figures()
    body = "\n".join([
        "## Mixture of experts and MLA (benchmarks/bench_moe.py)",
        "",
        f"MoE layer (hidden {HIDDEN}, {EXPERTS} routed experts of {EXPERT_INTER}, top-{TOP_K} "
        f"noaux_tc routing, + {SHARED} shared expert) with its routed experts in the fused C++ "
        "kernel (the cpu backend's path) and in the Python loop over experts (the torch path; "
        "experts with at most 16 float32 rows through the C++ few-row GEMM: the cpu backend's "
        f"path before the fused kernel), against GatedMLP({HIDDEN}, "
        f"{EXPERT_INTER * (TOP_K + SHARED)}) with the same active parameters; all with GEMM plans "
        f"and the extension's kernels. {torch.get_num_threads()} threads, median of {args.rounds} "
        f"interleaved rounds; extension ISA {isa}; load average {load_before:.1f} before, "
        f"{load_after:.1f} after (the machine is shared: the ratios, measured side by side, are "
        "the figures to read). bfloat16 on a CPU without AVX512_BF16 widens every weight to "
        "float32 (dense included).",
        "",
        "| dtype | tokens | fused ms | loop ms | dense ms (same active params) | loop / fused | "
        "fused / dense | experts hit |",
        "|---|---|---|---|---|---|---|---|",
        *layer,
        "",
        "KV cache per token, DeepSeek-V3's geometry (from the specs):",
        "",
        *kv,
        "",
        "Offline greedy generation, a small random DeepSeek-V3 (float32; transformers' "
        "generate with its cache, batched; openinfer's LLM):",
        "",
        *e2e,
    ])
    print(body)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", "bench_moe", body)


if __name__ == "__main__":
    main()
