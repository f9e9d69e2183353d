"""Decode through CUDA graphs against eager decode, one engine each, interleaved in one run.

A random-weight Qwen3-0.6B-shaped checkpoint (28 layers, hidden 1024, 16 query heads, 8 KV
heads, head_dim 128, bf16) is built once; three engines load it on the GPU: ``eager``
(``enforce_eager``), ``graphs`` (decode graphs captured) and ``graphs+async`` (graphs and
asynchronous scheduling: step N+1 scheduled while step N runs). For each batch size the engines
take turns: ``batch`` prompts of 32 tokens generate 1 token and then ``1 + DECODE_TOKENS``
tokens; decode tokens/s = batch x DECODE_TOKENS / (the difference of the two walls). Prints a
markdown table (GPU, commit, versions; median tokens/s of each engine, and the ratios to eager
with their spread over the repeats).

Needs CUDA (it says so and exits 0 without it). Called by ``benchmarks/gpu_check.sh``.

    python benchmarks/bench_decode_graphs.py [--batches 1 8 32] [--repeats 3] [--model DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT_TOKENS = 32
DECODE_TOKENS = 96
ENGINES = ("eager", "graphs", "graphs+async")


def build_checkpoint(path: Path) -> None:
    """Qwen3-0.6B's shape with random weights (bf16; the vocabulary cut to 32k to keep the
    build short: the LM head is outside the graphs either way)."""
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
        tie_word_embeddings=True, initializer_range=0.02)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)


def decode_tokens_per_s(llm, batch: int) -> float:
    from openinfer import SamplingParams

    prompts = [{"prompt_token_ids": [(7 * b + i) % 30000 + 1 for i in range(PROMPT_TOKENS)]}
               for b in range(batch)]

    def wall(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    wall(2)  # warm-up (kernels, allocator)
    return batch * DECODE_TOKENS / (wall(1 + DECODE_TOKENS) - wall(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", help="a checkpoint (default: build the random one)")
    parser.add_argument("--commit", default=os.environ.get("OPENINFER_COMMIT", "unknown"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode_graphs.py: no CUDA device here; nothing to time")
        return 0
    import triton

    from openinfer import LLM

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tmp
        if args.model is None:
            build_checkpoint(Path(tmp))
        engines = {name: LLM(model, device="cuda", dtype="bfloat16", skip_tokenizer_init=True,
                             enforce_eager=name == "eager", async_scheduling=name.endswith("async"),
                             max_num_seqs=max(args.batches), max_model_len=1024,
                             kv_cache_memory=2 * 2**30, progress=False)
                   for name in ENGINES}
        graphs = engines["graphs"].engine.core.executor.worker.runner.decode_graphs
        print(f"GPU: {torch.cuda.get_device_name()}  \ncommit: {args.commit}  \n"
              f"torch {torch.__version__}, triton {triton.__version__}; Qwen3-0.6B shape, "
              f"random bf16 weights; {PROMPT_TOKENS}-token prompts, {DECODE_TOKENS} decode tokens; "
              f"graphs captured: {sorted(graphs.graphs) if graphs else 'NONE'}\n")
        print("| batch | " + " | ".join(f"{name} tok/s" for name in ENGINES)
              + " | graphs / eager [range] | graphs+async / eager [range] |")
        print("|---:" * (len(ENGINES) + 3) + "|", flush=True)
        for batch in args.batches:
            rates: dict[str, list[float]] = {name: [] for name in ENGINES}
            for _ in range(args.repeats):
                for name, llm in engines.items():
                    rates[name].append(decode_tokens_per_s(llm, batch))
            cells = [f"{statistics.median(rates[name]):.0f}" for name in ENGINES]
            for name in ENGINES[1:]:
                ratios = sorted(f / e for f, e in zip(rates[name], rates["eager"]))
                cells.append(f"{statistics.median(ratios):.2f}x [{ratios[0]:.2f}-{ratios[-1]:.2f}]")
            print(f"| {batch} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
