"""Speculative decoding on a copy-heavy workload: decode tokens/s with and without it.

The model is the built-in SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32). The
prompts are chat requests that ask it to copy a 600-1500-token text with small changes: this
repository's Python sources ("add a docstring to every function", "add type hints", ...) and
its README and docs ("fix typos", "edit for clarity", "summarize section by section").
Greedy, up to ``--max-tokens`` tokens each; requests stop at end of sequence as they would.

Each engine configuration is one ``LLM`` (32 sequences, 4096-token context, prefix caching):

* ``plain``: no speculation (the baseline);
* ``ngram``, ``suffix``: k=4 drafts, every draft verified (fixed scheduler);
* ``ngram-confidence``, ``suffix-confidence``: k=4 drafts, DSpark's confidence scheduler
  choosing how many to verify (its steps/s profile cached in ~/.cache/openinfer/sps);
* ``draft_model``: k=4 drafts from the target truncated to its first ``--draft-layers``
  layers (no fine-tuning: no second real model that shares SmolLM2's tokenizer is at hand).

Every prompt is prefilled once first (one output token), so the timed runs measure decode,
not the 1-2k-token prefills. Concurrency 1 runs 3 single requests one after another,
concurrency C > 1 one batch of C requests; each concurrency has prompts of its own, so the
suffix drafter's tree of earlier outputs never holds a request's own greedy answer.
Figures: output tokens / wall seconds (ratio to ``plain`` at the same concurrency), tokens
per verifying request-step (1 + accepted / verifications), verify rows per request per decode
step (1 + verified drafts / decode steps), and how many outputs equal plain's token for token.

    .venv/bin/python benchmarks/bench_spec_decode.py [--no-write] [--max-tokens N]
        [--concurrency 1,8,32] [--configs plain,ngram,...] [--draft-layers N]
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from doc_sections import write_section
from offline_limits import cpu_busy_seconds, wait_until_quiet

from openinfer import LLM, SamplingParams
from openinfer.model_source import resolve_model
from openinfer.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2"
MAX_TOKENS = 192
CONCURRENCY = (1, 8, 32)
SINGLE_RUNS = 3
"""Concurrency 1: this many single requests, one after another."""
K = 4
DRAFT_LAYERS = 6
MAX_NUM_SEQS, MAX_MODEL_LEN = 32, 4096
KV_CACHE_MEMORY = 4 * 1024**3
"""Room for every prompt's prefix (~45k tokens at 46 KB a token, 55 KB with the draft)."""
TEXT_TOKENS = (700, 1000, 1300)
"""Target lengths of the texts, in turn; a text shorter than MIN_TEXT_TOKENS is dropped."""
MIN_TEXT_TOKENS = 600
QUIET_WAIT_S = 30
"""Before each timed run, wait up to this long for other processes to leave the CPUs."""

SPEC_CONFIGS: dict[str, dict | None] = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": K},
    "suffix": {"method": "suffix", "num_speculative_tokens": K},
    "ngram-confidence": {"method": "ngram", "num_speculative_tokens": K, "scheduler": "confidence"},
    "suffix-confidence": {"method": "suffix", "num_speculative_tokens": K, "scheduler": "confidence"},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": K},
    "dspark": {"method": "dspark", "num_speculative_tokens": K},
    "dspark-confidence": {"method": "dspark", "num_speculative_tokens": K, "scheduler": "confidence"},
    "ngram-budget": {"method": "ngram", "num_speculative_tokens": K, "scheduler": "budget"},
    "dspark-budget": {"method": "dspark", "num_speculative_tokens": K, "scheduler": "budget"},
}
LABELS = {"plain": "no speculation", "ngram": f"ngram k={K}", "suffix": f"suffix k={K}",
          "ngram-confidence": f"ngram k={K}, confidence", "suffix-confidence": f"suffix k={K}, confidence",
          "draft_model": f"draft model k={K}", "dspark": f"DSpark k={K}",
          "dspark-confidence": f"DSpark k={K}, confidence", "ngram-budget": f"ngram k={K}, budget",
          "dspark-budget": f"DSpark k={K}, budget"}
COUNTERS = ("spec_num_drafts", "spec_num_decode_steps", "spec_num_draft_tokens", "spec_num_accepted_tokens")

CODE_FILES = sorted((REPO / "openinfer").glob("*.py")) + sorted((REPO / "openinfer" / "engine").glob("*.py"))
PROSE_FILES = [REPO / "README.md", *(REPO / "docs" / f"{name}.md" for name in
                                     ("design", "models", "disaggregation", "metrics", "bench"))]
CODE_INSTRUCTIONS = (
    "Rewrite this code with a docstring on every function; keep the code unchanged otherwise:",
    "Add type hints to every function in this code and return the whole code; change nothing else:",
    "Refactor this code: rename every local variable called `i` to `index`, and return the code in full:",
)
CHAT_QUESTIONS = (
    "What are three good habits for staying healthy?",
    "Explain how a rainbow forms.",
    "Give me a simple recipe for pancakes.",
    "Why is the sky blue?",
    "What is the difference between a virus and a bacterium?",
    "Write a short poem about the sea.",
    "How do I prepare for a job interview?",
    "What causes the seasons on Earth?",
    "Explain what a computer's memory does.",
    "Suggest a name for a small bakery and explain why.",
    "How do plants make their food?",
    "What should I pack for a weekend camping trip?",
    "Describe the water cycle in a few sentences.",
    "What is the difference between weather and climate?",
    "Write a polite email asking a colleague for help with a report.",
    "Give three tips for learning a new language.",
    "Explain what an atom is to a child.",
    "What are the benefits of reading books?",
    "How does a bicycle stay upright?",
    "Tell me a short story about a lost cat who finds its way home.",
    "What is photosynthesis?",
    "How can I save money on groceries?",
    "Explain the rules of chess briefly.",
    "What makes a good friend?",
    "Why do we need sleep?",
    "Describe a sunset to someone who has never seen one.",
    "What are some ways to reduce stress?",
    "How do airplanes fly?",
    "What is the purpose of a museum?",
    "Give me a plan for a productive morning.",
    "Explain why recycling matters.",
    "What is the difference between a lake and a sea?",
    "How do vaccines work?",
    "Write a thank-you note to a teacher.",
    "What are the main parts of a cell?",
    "Why do leaves change color in autumn?",
    "How can I become a better listener?",
    "Explain what gravity is.",
    "What should a beginner know about running?",
    "Describe your ideal weekend.",
    "What is the role of the heart in the body?",
    "How do I make a cup of tea?",
    "What are the planets of the solar system?",
    "Give advice to someone starting their first job.",
)
"""Ordinary chat requests, none a copy task (written for this benchmark; the shipped DSpark
drafter's training text is other: scripts/dspark_data.py)."""
PROSE_INSTRUCTIONS = (
    "Fix typos in the following text and return it in full:",
    "Edit the following text for clarity, keeping its structure and code blocks, and return it in full:",
    "Summarize the following text section by section, quoting each section's heading:",
)


@dataclass
class Run:
    tokens: int
    seconds: float
    counters: dict[str, int]
    """The spec_* counters' increase over the run (zero without speculation)."""
    outputs: list[list[int]]
    other_cores: float
    """CPU that other processes used during the run, in cores (busy time in /proc/stat minus
    this process's own, over the wall time)."""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def chunks(path: Path, tokenizer, phase: int) -> list[str]:
    """The file cut at line ends into texts of about TEXT_TOKENS tokens (in turn, from the
    ``phase``-th on, so that files' first texts differ in length)."""
    texts, lines, count = [], [], 0
    for line in path.read_text().splitlines(keepends=True):
        lines.append(line)
        count += len(tokenizer.encode(line, add_special_tokens=False))
        if count >= TEXT_TOKENS[(phase + len(texts)) % len(TEXT_TOKENS)]:
            texts.append("".join(lines))
            lines, count = [], 0
    if count >= MIN_TEXT_TOKENS:
        texts.append("".join(lines))
    return texts


def interleave(groups: list[list[str]]) -> list[str]:
    """The first item of every group, then every group's second, and so on."""
    longest = max(len(g) for g in groups)
    return [g[i] for i in range(longest) for g in groups if i < len(g)]


def build_prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` chat prompts (token ids) that alternate code and prose, files and instructions."""
    code = interleave([chunks(p, tokenizer, i) for i, p in enumerate(CODE_FILES)])
    prose = interleave([chunks(p, tokenizer, i) for i, p in enumerate(PROSE_FILES)])
    messages = []
    for i in range(max(len(code), len(prose))):
        if i < len(code):
            instruction = CODE_INSTRUCTIONS[i % len(CODE_INSTRUCTIONS)]
            messages.append(f"{instruction}\n\n```python\n{code[i]}```")
        if i < len(prose):
            messages.append(f"{PROSE_INSTRUCTIONS[i % len(PROSE_INSTRUCTIONS)]}\n\n{prose[i]}")
    if len(messages) < count:
        raise SystemExit(f"only {len(messages)} texts of {MIN_TEXT_TOKENS}+ tokens, {count} needed")
    return [tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for m in messages[:count]]


def build_chat_prompts(tokenizer, count: int) -> list[list[int]]:
    if count > len(CHAT_QUESTIONS):
        raise SystemExit(f"only {len(CHAT_QUESTIONS)} chat questions, {count} needed")
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            for q in CHAT_QUESTIONS[:count]]


def build_draft(path: str, tokenizer, num_layers: int) -> None:
    """The target's first ``num_layers`` layers (with its embeddings, final norm and head) as a
    Hugging Face checkpoint, with the target's tokenizer."""
    import transformers

    folder, name = os.path.split(resolve_model(MODEL).path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    del model.config.quantization_config  # the GGUF's; the saved weights are plain float32
    model.hf_quantizer = None
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def make_llm(config: str, draft_path: str) -> LLM:
    spec = SPEC_CONFIGS[config]
    if spec is not None and spec["method"] == "draft_model":
        spec = {**spec, "model": draft_path}
    return LLM(MODEL, progress=False, speculative_config=spec, max_num_seqs=MAX_NUM_SEQS,
               max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True, kv_cache_memory=KV_CACHE_MEMORY)


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def counters(llm: LLM) -> dict[str, int]:
    stats = llm.engine.core.stats()
    return {name: stats.get(name, 0) for name in COUNTERS}


def measure(llm: LLM, prompt_sets: dict[int, list[list[int]]], params: SamplingParams) -> dict[int, Run]:
    """Prefill every prompt (one output token), then time each concurrency's requests."""
    llm.generate([p for prompts in prompt_sets.values() for p in prompts],
                 SamplingParams(temperature=0, max_tokens=1))
    runs = {}
    for concurrency, prompts in prompt_sets.items():
        batches = [[p] for p in prompts] if concurrency == 1 else [prompts]
        wait_until_quiet(QUIET_WAIT_S)
        before, busy, own = counters(llm), cpu_busy_seconds(), own_cpu_seconds()
        start = time.perf_counter()
        results = [out for batch in batches for out in llm.generate(batch, params)]
        seconds = time.perf_counter() - start
        other = (cpu_busy_seconds() - busy - (own_cpu_seconds() - own)) / seconds
        after = counters(llm)
        outputs = [list(r.outputs[0].token_ids) for r in results]
        run = runs[concurrency] = Run(sum(map(len, outputs)), seconds,
                                      {n: after[n] - before[n] for n in COUNTERS}, outputs, max(other, 0.0))
        cached = sum(r.num_cached_tokens for r in results) / sum(len(r.prompt_token_ids) for r in results)
        print(f"  C={concurrency}: {run.tokens} tokens in {seconds:.1f} s = {run.tokens_per_second:.1f} "
              f"tok/s (prompt tokens cached: {cached:.0%}, other processes: {run.other_cores:.2f} cores)",
              flush=True)
    return runs


def throughput_cell(run: Run, base: Run | None) -> str:
    if base is None:
        return f"{run.tokens_per_second:.1f} tok/s"
    return f"{run.tokens_per_second / base.tokens_per_second:.2f}x ({run.tokens_per_second:.1f} tok/s)"


def paying(label: str, runs: dict[int, Run], base: dict[int, Run]) -> str:
    """Where speculation stops paying: the first concurrency whose ratio to plain is below 1."""
    ratios = {c: run.tokens_per_second / base[c].tokens_per_second for c, run in runs.items()}
    below = [c for c, ratio in ratios.items() if ratio < 1.0]
    if not below:
        return f"{label}: pays at every concurrency measured"
    if len(below) == len(ratios):
        return f"{label}: pays at no concurrency measured (best {max(ratios.values()):.2f}x)"
    return f"{label}: stops paying at concurrency {below[0]} ({ratios[below[0]]:.2f}x)"


def report(results: dict[str, dict[int, Run]], concurrencies: list[int]) -> str:
    base = results.get("plain")
    first = next(iter(results))
    tokens = ", ".join(f"C={c}: {results[first][c].tokens / len(results[first][c].outputs):.0f}"
                       for c in concurrencies)
    head = " | ".join(f"C={c}" for c in concurrencies)
    rows = [f"Output tokens per request, mean ({LABELS[first]}): {tokens}.", "",
            f"| configuration | {head} | other processes' CPU (cores) |",
            "|---" * (len(concurrencies) + 2) + "|"]
    for config, runs in results.items():
        cells = " | ".join(throughput_cell(runs[c], base[c] if base else None) for c in concurrencies)
        noise = " / ".join(f"{runs[c].other_cores:.2f}" for c in concurrencies)
        rows.append(f"| {LABELS[config]} | {cells} | {noise} |")
    head = " | ".join(f"C={c}: tokens / verification | C={c}: verify rows / request-step"
                      for c in concurrencies)
    same = " | same tokens as plain" if base else ""
    columns = 2 * len(concurrencies) + 1 + bool(base)
    rows += ["", f"| configuration | {head}{same} |", "|---" * columns + "|"]
    for config, runs in results.items():
        if config == "plain":
            continue
        cells = []
        for c in concurrencies:
            n = runs[c].counters
            cells.append(f"{1 + n['spec_num_accepted_tokens'] / n['spec_num_drafts']:.2f}"
                         if n["spec_num_drafts"] else "-")
            cells.append(f"{1 + n['spec_num_draft_tokens'] / n['spec_num_decode_steps']:.2f}"
                         if n["spec_num_decode_steps"] else "-")
        if base:
            pairs = [(a, b) for c in concurrencies for a, b in zip(runs[c].outputs, base[c].outputs)]
            cells.append(f"{sum(a == b for a, b in pairs)}/{len(pairs)}")
        rows.append(f"| {LABELS[config]} | {' | '.join(cells)} |")
    if base:
        rows.append("")
        rows += [f"- {paying(LABELS[config], runs, base)}" for config, runs in results.items()
                 if config != "plain"]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                        help="output tokens per request at most")
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)),
                        help="comma-separated concurrencies")
    parser.add_argument("--configs", default=",".join(SPEC_CONFIGS),
                        help=f"comma-separated, of: {', '.join(SPEC_CONFIGS)}")
    parser.add_argument("--prompts", choices=["copy", "chat"], default="copy",
                        help="copy: copy-heavy edits of this repository's files; chat: ordinary "
                             "chat questions (written to their own section)")
    parser.add_argument("--draft-layers", type=int, default=DRAFT_LAYERS,
                        help="draft_model: the target's first N layers (of 30)")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    configs = args.configs.split(",")
    unknown = sorted(set(configs) - set(SPEC_CONFIGS))
    if unknown:
        parser.error(f"unknown config(s): {', '.join(unknown)}")
    if max(concurrencies) > MAX_NUM_SEQS:
        parser.error(f"concurrency is at most max_num_seqs ({MAX_NUM_SEQS})")

    tokenizer = load_tokenizer(resolve_model(MODEL).path)
    sizes = [SINGLE_RUNS if c == 1 else c for c in concurrencies]
    chat = args.prompts == "chat"
    prompts = (build_chat_prompts if chat else build_prompts)(tokenizer, sum(sizes))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    prompt_sets = {c: prompts[s:s + n] for c, s, n in zip(concurrencies, starts, sizes)}
    lengths = [len(p) for p in prompts]
    print(f"{len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens "
          f"(mean {sum(lengths) / len(lengths):.0f})", flush=True)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    results: dict[str, dict[int, Run]] = {}
    with tempfile.TemporaryDirectory() as draft_path:
        if "draft_model" in configs:
            build_draft(draft_path, tokenizer, args.draft_layers)
        for config in configs:
            print(f"{LABELS[config]}:", flush=True)
            llm = make_llm(config, draft_path)
            dtype = str(llm.engine.config.model.dtype).removeprefix("torch.")
            results[config] = measure(llm, prompt_sets, params)
            del llm
            gc.collect()
    table = report(results, concurrencies)
    draft = (f" The draft model is the target truncated to its first {args.draft_layers} of 30 layers "
             "(its embeddings, final norm and head kept, no fine-tuning): no second real model with "
             "SmolLM2's tokenizer is at hand." if "draft_model" in configs else "")
    dspark = (" DSpark is the drafter that ships for SmolLM2 (openinfer/drafters, trained by "
              "scripts/train_dspark.py on the target's own answers to prompts built from installed "
              "packages' text: neither this repository's files nor these questions)."
              if any(c.startswith("dspark") for c in configs) else "")
    if chat:
        title, workload = "Speculative decoding on ordinary chat", (
            f"{len(prompts)} ordinary chat questions of {min(lengths)}-{max(lengths)} tokens "
            "(written for this benchmark, none a copy task)")
    else:
        title, workload = "Speculative decoding", (
            f"{len(prompts)} copy-heavy chat prompts of {min(lengths)}-{max(lengths)} tokens (this "
            "repository's Python files to document, annotate or refactor; its README and docs to "
            "proofread, edit or summarize)")
    bf16 = ("\nSame tokens as plain: in bfloat16 a verify step's multi-row GEMMs round otherwise than "
            "a decode's one row, so an output leaves plain's at the first near tie (float32 keeps "
            "plain's tokens: tests/spec; --batch-invariant promises them in bfloat16)."
            if dtype == "bfloat16" else "")
    body = f"""## {title} (benchmarks/bench_spec_decode.py{" --prompts chat" if chat else ""})

SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to {dtype}) on the CPU, {workload}, greedy, at
most {args.max_tokens} output tokens, stopping at end of sequence. Every prompt is prefilled before
the timed runs (prefix cache), so the figures are decode: output tokens / wall seconds, as a
ratio to no speculation at the same concurrency. Concurrency 1 is {SINGLE_RUNS} requests one
after another; each concurrency has prompts of its own.{draft}{dspark}

{table}

Other processes' CPU: what other processes used of the {os.cpu_count()} cores during each
concurrency's run (in order); a run beside more than ~0.2 busy cores is not reliable.
Tokens / verification: 1 + accepted drafts / request-steps that verified at least one draft.{bf16}
Verify rows / request-step: 1 + drafts verified / decode request-steps (with k={K} fixed it is
at most {K + 1}; the confidence scheduler is meant to verify fewer as the batch grows).
"""
    print(body)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", "spec-decode-chat" if chat else "spec-decode",
                      body)


if __name__ == "__main__":
    main()
