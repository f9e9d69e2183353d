"""``--kv-cache-dtype fp8`` beside the model-dtype cache: what it buys (tokens per GiB, decode
speed at long context) and what it costs (greedy tokens that part from the plain cache's).

1. The attention kernel alone: a batch of decodes over long contexts, each cache dtype with
   the query dtype a model would give it, seconds per call and the cache bytes it reads.
2. The engine, each variant in its own process, rounds interleaved: a batch of requests with
   long prompts, decode tokens/s (generated tokens less the first, over the time past the
   first), and the KV blocks one GiB holds. Models: the built-in SmolLM2-135M (real weights)
   and the peers' dense qwen3-0.4b-random.
3. Closeness, on SmolLM2's real weights: greedy continuations of a set of prompts with a
   float8 cache against the model-dtype cache, the share identical to the end and the mean
   length of the common prefix.

    .venv/bin/python benchmarks/bench_kv_cache_dtype.py [--rounds 3] [--output PAGE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from doc_sections import write_section  # noqa: E402

from openinfer.kernels.cpu_attention import load_cpu_attention, paged_attention  # noqa: E402
from openinfer.kernels.kv_quant import quantize_kv  # noqa: E402

PEER_MODEL = Path.home() / ".cache/openinfer-peers/models/qwen3-0.4b-random"
KERNEL_VARIANTS = [  # (label, query dtype, cache dtype)
    ("fp32 cache", torch.float32, torch.float32),
    ("bf16 cache", torch.bfloat16, torch.bfloat16),
    ("fp8 e4m3, fp32 q", torch.float32, torch.float8_e4m3fn),
    ("fp8 e4m3, bf16 q", torch.bfloat16, torch.float8_e4m3fn),
    ("fp8 e5m2, bf16 q", torch.bfloat16, torch.float8_e5m2),
]
ENGINE_VARIANTS = ["auto", "fp8", "fp8_e5m2"]

_ENGINE = r"""
import json, sys, time
from openinfer import LLM, SamplingParams
model, dtype, kv, prompt_len, batch, gen = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
llm = LLM(model, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=1 << 30, progress=False,
          max_model_len=prompt_len + gen + 8, enable_prefix_caching=False)
prompts = [{"prompt_token_ids": [(37 * i + 11 * j) % 20000 + 100 for j in range(prompt_len)]}
           for i in range(batch)]
def run(n):
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return time.perf_counter() - start
run(2)  # warm-up
one, many = run(1), run(gen)
print(json.dumps({"tok_s": batch * (gen - 1) / (many - one), "blocks": llm.engine.core.kv.num_blocks,
                  "block_size": llm.engine.core.config.cache.block_size}))
"""

_CLOSENESS = r"""
import json, sys
from openinfer import LLM, SamplingParams
llm = LLM("smollm2", kv_cache_dtype=sys.argv[1], progress=False)
topics = ["the history of the printing press", "how a refrigerator works", "why the sky is blue",
          "the rules of chess", "photosynthesis", "the French revolution", "how vaccines work",
          "black holes", "the water cycle", "how to bake bread", "the stock market",
          "plate tectonics", "the internet's origins", "how airplanes fly", "the human heart",
          "climate and weather", "ancient Rome", "how batteries store energy", "volcanoes",
          "the theory of evolution", "how compilers work", "the Moon landing", "honey bees",
          "the immune system"]
messages = [[{"role": "user", "content": f"Explain {t} in a few paragraphs."}] for t in topics]
outs = llm.chat(messages, SamplingParams(temperature=0, max_tokens=int(sys.argv[2]), ignore_eos=True))
print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def time_kernel(q_dtype: torch.dtype, cache_dtype: torch.dtype, batch: int, context: int,
                heads: int = 16, kv_heads: int = 8, head_dim: int = 128, block_size: int = 16,
                reps: int = 20) -> tuple[float, int]:
    """Best seconds per call of a decode batch, and the cache bytes the call reads."""
    gen = torch.Generator().manual_seed(0)
    blocks = batch * -(-context // block_size)
    kv = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=gen)
    cache = torch.stack([quantize_kv(kv[0], 1.0, cache_dtype), quantize_kv(kv[1], 1.0, cache_dtype)])
    tables = torch.arange(blocks, dtype=torch.int32).view(batch, -1)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(q_dtype)
    out = torch.empty_like(q)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        paged_attention(out, q, cache[0], cache[1], tables, qsl, lens, head_dim ** -0.5, 1)
        best = min(best, time.perf_counter() - start)
    return best, batch * context * 2 * kv_heads * head_dim * cache.element_size()


def kernel_table(rounds: int, batch: int = 8) -> str:
    rows = []
    for context in (1024, 4096):
        times: dict[str, list[float]] = {label: [] for label, *_ in KERNEL_VARIANTS}
        read: dict[str, int] = {}
        for _ in range(rounds):
            for label, q_dtype, cache_dtype in KERNEL_VARIANTS:
                seconds, read[label] = time_kernel(q_dtype, cache_dtype, batch, context)
                times[label].append(seconds)
        base = statistics.median(times["bf16 cache"])
        for label, *_ in KERNEL_VARIANTS:
            t = statistics.median(times[label])
            rows.append(f"| {batch} x {context} | {label} | {read[label] / 2**20:.0f} | {t * 1e3:.2f} | "
                        f"{read[label] / t / 1e9:.1f} | {base / t:.2f} |")
    return ("| decodes x context | cache | MiB read | ms per call | GB/s | speed vs bf16 cache |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(rows))


def run_engine(model: str, dtype: str, kv: str, prompt_len: int, batch: int, gen: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _ENGINE, model, dtype, kv, str(prompt_len), str(batch),
                          str(gen)], capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def engine_table(rounds: int) -> str:
    configs = [("smollm2", "smollm2", "float32", 2048, 8, 33)]
    if PEER_MODEL.exists():
        configs += [("qwen3-0.4b-random", str(PEER_MODEL), dtype, 1024, 8, 33)
                    for dtype in ("float32", "bfloat16")]
    rows = []
    for name, model, dtype, prompt_len, batch, gen in configs:
        results: dict[str, list[dict]] = {kv: [] for kv in ENGINE_VARIANTS}
        for _ in range(rounds):
            for kv in ENGINE_VARIANTS:
                results[kv].append(run_engine(model, dtype, kv, prompt_len, batch, gen))
        base = statistics.median(r["tok_s"] for r in results["auto"])
        for kv in ENGINE_VARIANTS:
            tok_s = statistics.median(r["tok_s"] for r in results[kv])
            tokens = results[kv][0]["blocks"] * results[kv][0]["block_size"]
            rows.append(f"| {name} ({dtype}) | {batch} x {prompt_len} | {kv} | {tokens:,} | "
                        f"{tok_s:.1f} | {tok_s / base:.2f} |")
    return ("| model | requests x prompt | --kv-cache-dtype | tokens in 1 GiB of KV | "
            "decode tok/s | vs auto |\n|---|---|---|---|---|---|\n" + "\n".join(rows))


def closeness_table(tokens: int = 64) -> str:
    runs = {}
    for kv in ENGINE_VARIANTS:
        out = subprocess.run([sys.executable, "-c", _CLOSENESS, kv, str(tokens)], capture_output=True,
                             text=True, timeout=1800)
        if out.returncode:
            raise RuntimeError(out.stderr[-2000:])
        runs[kv] = json.loads(out.stdout.strip().splitlines()[-1])
    rows = []
    for kv in ENGINE_VARIANTS[1:]:
        prefixes = []
        for plain, quantized in zip(runs["auto"], runs[kv]):
            n = next((i for i, (a, b) in enumerate(zip(plain, quantized)) if a != b), len(plain))
            prefixes.append(n)
        same = sum(n == tokens for n in prefixes)
        rows.append(f"| {kv} | {len(prefixes)} | {same} ({same / len(prefixes):.0%}) | "
                    f"{statistics.mean(prefixes):.1f} of {tokens} | {min(prefixes)} |")
    return ("| --kv-cache-dtype | prompts | identical to auto's 64 tokens | mean common prefix | "
            "shortest |\n|---|---|---|---|---|\n" + "\n".join(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", help="write the section into this Markdown page")
    args = parser.parse_args()
    if load_cpu_attention() is None:
        raise SystemExit("the CPU attention extension could not be built")
    torch.set_num_threads(torch.get_num_threads())
    kernel = kernel_table(args.rounds)
    print(kernel, flush=True)
    engine = engine_table(args.rounds)
    print(engine, flush=True)
    closeness = closeness_table()
    print(closeness, flush=True)
    body = (
        "Float8 KV caches (`--kv-cache-dtype fp8` = e4m3, `fp8_e5m2`) beside the model-dtype cache "
        "(`auto`). Scales: 1.0 (the checkpoints carry no k/v scales).\n\n"
        "**The attention kernel**, a batch of decodes (16 query heads, 8 KV heads, head_dim 128), "
        f"median of {args.rounds} interleaved rounds of the best of 20 calls:\n\n{kernel}\n\n"
        "**The engine**, each variant in its own process, rounds interleaved, median of "
        f"{args.rounds}; decode tok/s over the batch, prefix caching off:\n\n{engine}\n\n"
        "**Closeness** on SmolLM2-135M-Instruct's real weights (float32 compute): greedy "
        "continuations of 24 chat prompts, 64 tokens each, with a float8 cache against the "
        f"float32 cache:\n\n{closeness}\n")
    if args.output:
        write_section(Path(args.output), "bench_kv_cache_dtype", body)


if __name__ == "__main__":
    main()
