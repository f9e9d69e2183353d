"""``--kv-cache-dtype fp8`` beside the model-dtype cache: what it buys (tokens per GiB, decode
speed at long context) and what it costs (greedy tokens that part from the plain cache's).

1. The attention kernel alone: a batch of decodes over long contexts, each cache dtype with
   the query dtype a model would give it, seconds per call and the cache bytes it reads.
2. The engine, each variant in its own process, rounds interleaved: a batch of requests with
   long prompts (prefilled once, then prefix hits), decode tokens/s (generated tokens less the
   first, over the time past a one-token run), and the KV blocks one GiB holds. Models: the
   built-in SmolLM2-135M (real weights) and the peers' dense qwen3-0.4b-random.
3. Closeness, on SmolLM2's real weights: the model-dtype cache's greedy continuations of a set
   of prompts, read back by each cache (teacher-forced: how often its top-1 token is the
   plain cache's), and each cache's own greedy text (how far it follows the plain cache's).

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
          max_model_len=prompt_len + gen + 8)
prompts = [{"prompt_token_ids": [(37 * i + 11 * j) % 20000 + 100 for j in range(prompt_len)]}
           for i in range(batch)]
def run(n):
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return time.perf_counter() - start
run(2)  # the prompts' KV into the prefix cache: the runs below prefill their last block only
one, many = run(1), run(gen)
print(json.dumps({"tok_s": batch * (gen - 1) / (many - one), "blocks": llm.engine.core.kv.num_blocks,
                  "block_size": llm.engine.core.config.cache.block_size}))
"""

_CLOSENESS = r"""
import json, sys
from openinfer import LLM, SamplingParams
llm = LLM("smollm2", kv_cache_dtype=sys.argv[1], progress=False)
tokens, reference = int(sys.argv[2]), json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
topics = ["the history of the printing press", "how a refrigerator works", "why the sky is blue",
          "the rules of chess", "photosynthesis", "the French revolution", "how vaccines work",
          "black holes", "the water cycle", "how to bake bread", "the stock market",
          "plate tectonics", "the internet's origins", "how airplanes fly", "the human heart",
          "climate and weather", "ancient Rome", "how batteries store energy", "volcanoes",
          "the theory of evolution", "how compilers work", "the Moon landing", "honey bees",
          "the immune system"]
tokenizer = llm.get_tokenizer()
prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Explain {t} in a few paragraphs."}],
                                         add_generation_prompt=True, tokenize=True) for t in topics]
prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
greedy = [list(o.outputs[0].token_ids) for o in outs]
ranks = []
if reference is not None:  # teacher-forced: this cache's rank of each of the reference's tokens
    scored = llm.generate([{"prompt_token_ids": p + r} for p, r in zip(prompts, reference)],
                          SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    for p, r, o in zip(prompts, reference, scored):
        ranks += [o.prompt_logprobs[len(p) + i][t].rank for i, t in enumerate(r)]
print(json.dumps({"greedy": greedy, "ranks": ranks}))
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
    configs = [("smollm2", "smollm2", "float32", 2048, 4, 33)]
    if PEER_MODEL.exists():
        configs += [("qwen3-0.4b-random", str(PEER_MODEL), dtype, 1024, 4, 33)
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
    def run(kv: str, *reference) -> dict:
        out = subprocess.run([sys.executable, "-c", _CLOSENESS, kv, str(tokens), *reference],
                             capture_output=True, text=True, timeout=1800)
        if out.returncode:
            raise RuntimeError(out.stderr[-2000:])
        return json.loads(out.stdout.strip().splitlines()[-1])

    plain = run("auto")["greedy"]
    rows = []
    for kv in ENGINE_VARIANTS:
        result = run(kv, json.dumps(plain))
        prefixes = [next((i for i, (a, b) in enumerate(zip(p, q)) if a != b), len(p))
                    for p, q in zip(plain, result["greedy"])]
        same = sum(n == tokens for n in prefixes)
        top1 = sum(r == 1 for r in result["ranks"]) / len(result["ranks"])
        rows.append(f"| {kv} | {top1:.1%} | {same} of {len(prefixes)} | "
                    f"{statistics.mean(prefixes):.1f} of {tokens} | {min(prefixes)} |")
    return ("| --kv-cache-dtype | teacher-forced top-1 = auto's token | continuations identical to "
            "auto's | mean common prefix | shortest |\n|---|---|---|---|---|\n" + "\n".join(rows))


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
        f"{args.rounds}; decode tok/s over the batch (the prompts' KV read from the cache):\n\n"
        f"{engine}\n\n"
        "**Closeness** on SmolLM2-135M-Instruct's real weights (float32 compute), 24 chat "
        "prompts: the float32 cache's (`auto`) greedy continuations of 64 tokens, then each cache "
        "reading those same tokens (prompt logprobs): how often its own top-1 token is auto's "
        "(auto against itself: the check of the measure), and how far its own greedy text "
        f"follows auto's:\n\n{closeness}\n")
    if args.output:
        write_section(Path(args.output), "bench_kv_cache_dtype", body)


if __name__ == "__main__":
    main()
