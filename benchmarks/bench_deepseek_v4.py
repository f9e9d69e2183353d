"""DeepSeek-V4 end to end (issue 15): offline greedy generation of a small random V4 (every
attention type, hash and scored MoE layers, hyper-connections) built here with transformers, by
openinfer's LLM and by transformers' cached generate, same prompts, same process; and steps of
many sequences (openinfer alone: prefills of many prompts of mixed lengths, decodes of 8 and 32
sequences), whose attention runs over padded batches of the step's sequences. Attention runs
in torch (no fused kernel), so this is where the model stands before one, not a kernel figure.

    .venv/bin/python benchmarks/bench_deepseek_v4.py [--no-write]
    PYTHONPATH=<a checkout> .venv/bin/python benchmarks/bench_deepseek_v4.py --steps-only
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from doc_sections import write_section

REPO = Path(__file__).resolve().parent.parent
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
CONFIG = dict(vocab_size=4096, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=1, head_dim=64, q_lora_rank=64,
              partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=8,
              layer_types=[SLIDING, CSA, HCA, CSA],
              compress_rates={CSA: 4, HCA: 16}, mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
              sliding_window=32, o_groups=2, o_lora_rank=32, index_n_heads=4, index_head_dim=32,
              index_topk=1024, hc_mult=4, max_position_embeddings=4096)


def transformers_generate(hf, prompts: torch.Tensor, new_tokens: int) -> tuple[float, list[list[int]]]:
    """(seconds, tokens) of transformers' cached greedy generate, one prompt at a time (its V4
    compressors do not take padded batches)."""
    start, out = time.perf_counter(), []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(p[None], attention_mask=torch.ones(1, p.shape[0]), do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens)
            out.append(ids[0, p.shape[0]:].tolist())
    return time.perf_counter() - start, out


def figures(batch: int = 8, prompt_len: int = 128, new_tokens: int = 32,
            steps_only: bool = False) -> tuple[str, str]:
    """(the end-to-end table, the many-sequence steps' table)."""
    import transformers

    from openinfer import LLM, SamplingParams

    torch.manual_seed(0)
    config = transformers.DeepseekV4Config(**CONFIG)
    config.architectures = ["DeepseekV4ForCausalLM"]
    hf = transformers.DeepseekV4ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(10, CONFIG["vocab_size"], (batch, prompt_len), generator=g)
    rows = ["| engine | wall s | output tokens/s | sequences equal to transformers' |", "|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as path:
        hf.save_pretrained(path)
        steps = step_figures(path)
        if steps_only:
            return "", steps
        llm = LLM(path, progress=False, enable_prefix_caching=False, skip_tokenizer_init=True)
        sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        llm.generate(prompts[:2, :16].tolist(), sp)  # warm-up
        start = time.perf_counter()
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts.tolist(), sp)]
        ours_s = time.perf_counter() - start
        theirs_s, theirs = transformers_generate(hf, prompts, new_tokens)
    same = sum(a == b for a, b in zip(ours, theirs))
    total = batch * new_tokens
    rows.append(f"| openinfer (batched steps, V4 attention in torch) | {ours_s:.2f} | "
                f"{total / ours_s:.1f} | {same}/{batch} |")
    rows.append(f"| transformers (cached generate, one at a time) | {theirs_s:.2f} | "
                f"{total / theirs_s:.1f} | - |")
    rows.append(f"| openinfer / transformers | | {theirs_s / ours_s:.2f}x | |")
    return "\n".join(rows), steps


def step_figures(path: str, reps: int = 3) -> str:
    """Steps of many sequences (best of ``reps``): prefills of many prompts of mixed lengths,
    one output token each, with a step budget that takes them in one or two steps; decodes of
    8 and 32 sequences."""
    from openinfer import LLM, SamplingParams

    g = torch.Generator().manual_seed(2)
    llm = LLM(path, progress=False, enable_prefix_caching=False, skip_tokenizer_init=True,
              max_num_batched_tokens=4096, max_num_seqs=64)

    def best(prompts: list[list[int]], sp: SamplingParams) -> float:
        llm.generate(prompts[:2], sp)  # warm-up
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            llm.generate(prompts, sp)
            times.append(time.perf_counter() - start)
        return min(times)

    rows = ["| load | wall s (best of 3) | tokens/s |", "|---|---|---|"]
    for count, shortest, longest in [(64, 8, 24), (32, 32, 256)]:
        lengths = torch.randint(shortest, longest + 1, (count,), generator=g).tolist()
        prompts = [torch.randint(10, CONFIG["vocab_size"], (n,), generator=g).tolist() for n in lengths]
        seconds = best(prompts, SamplingParams(temperature=0, max_tokens=1))
        rows.append(f"| prefill: {count} prompts of {shortest}-{longest} tokens ({sum(lengths)} in "
                    f"all), 1 output token each | {seconds:.3f} | {sum(lengths) / seconds:.0f} prompt |")
    for count in (8, 32):
        prompts = torch.randint(10, CONFIG["vocab_size"], (count, 16), generator=g).tolist()
        seconds = best(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        rows.append(f"| decode: {count} sequences (16-token prompts), 64 tokens each | {seconds:.3f} | "
                    f"{count * 64 / seconds:.0f} output |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--steps-only", action="store_true",
                        help="the many-sequence steps alone (print only; for A/B runs of two commits)")
    args = parser.parse_args()
    table, steps = figures(steps_only=args.steps_only)
    if args.steps_only:
        print(steps)
        return
    body = f"""## DeepSeek-V4 end to end (benchmarks/bench_deepseek_v4.py)

A random DeepSeek-V4 (4 layers: sliding, CSA, HCA, CSA; hidden 256, 8 heads of 64, window 32,
CSA ratio 4 with a 4-head indexer, HCA ratio 16, 8 experts top-2, float32), 8 prompts of 128
tokens, 32 greedy tokens each. transformers' V4 compressors do not take padded batches, so it
generates one sequence at a time; openinfer batches the step (its decodes attend in one padded
batch, its prefill chunks in groups of similar length, all in torch: no fused V4 kernel yet).

{table}

Steps of many sequences (openinfer alone; `max_num_batched_tokens` 4096, so a prefill load
takes one or two steps):

{steps}
"""
    print(body)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", "bench_deepseek_v4", body)


if __name__ == "__main__":
    main()
