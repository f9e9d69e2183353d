"""`openinfer bench` on the demo model: a request-rate sweep, multi-turn cache hits, economics.

Starts `openinfer serve` on the demo model (the `tiny` preset `make serve` uses, or
--model), then runs the real CLI:

1. `bench serve --workload random` (128 -> 32 tokens) at several Poisson request rates
   plus all-at-once, and `bench compare --plot` for the latency/throughput curves
   (docs/img/bench_serving_sweep.png).
2. `bench serve --workload multi-turn` (8 users x 4 turns, a 256-token system prompt per
   user, each turn resending the conversation): the server's input-cache hit rate from
   `usage` next to the workload's oracle rate.
3. The economics rows of both (DeepSeek-shaped list prices, $2/accelerator-hour as a
   placeholder: a CPU box is no accelerator; the arithmetic is the point).

    .venv/bin/python benchmarks/bench_serving.py            # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_server import ensure_demo_model, start_server  # benchmarks/ is on sys.path when run as a script
from doc_sections import write_section

REPO = Path(__file__).resolve().parent.parent
SECTION = "bench_serving"
PLOT = REPO / "docs" / "img" / "bench_serving_sweep.png"


def bench(*args: str) -> str:
    cmd = [sys.executable, "-m", "openinfer.cli", "bench", *args]
    print("$ openinfer bench " + " ".join(args), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"openinfer bench failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint (default: the demo model, tiny preset)")
    parser.add_argument("--rates", default="4,8,16,32,inf")
    parser.add_argument("--output", default=str(REPO / "docs" / "benchmarks.md"))
    args = parser.parse_args()
    model = ensure_demo_model(args.model)
    started = time.perf_counter()
    base, proc = start_server(model)
    common = ["--base-url", base, "--model", "bench", "--tokenizer", model, "--no-progress"]
    with tempfile.TemporaryDirectory() as tmp:
        sweep, turns = Path(tmp) / "random-sweep.json", Path(tmp) / "multi-turn.json"
        try:
            bench("serve", *common, "--workload", "random", "--num-requests", "64",
                  "--input-len", "128", "--output-len", "32", "--request-rate", args.rates,
                  "--slo", "ttft=200,tpot=50", "--output", str(sweep))
            bench("serve", *common, "--workload", "multi-turn", "--num-users", "8",
                  "--num-turns", "4", "--prefix-len", "256", "--input-len", "32",
                  "--output-len", "16", "--concurrency", "8", "--output", str(turns))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        PLOT.parent.mkdir(parents=True, exist_ok=True)
        sweep_table = bench("compare", str(sweep), "--markdown", "--plot", str(PLOT))
        turns_table = bench("compare", str(turns), "--markdown")
        multi = json.loads(turns.read_text())["runs"][0]["summary"]
    sweep_table = sweep_table.split("plot written")[0].strip()
    report = "\n".join([
        "## Serving benchmark (`benchmarks/bench_serving.py`, `openinfer bench`)",
        "",
        f"{dt.datetime.now():%Y-%m-%d %H:%M}, {os.cpu_count()} cores, the demo model (tiny "
        f"preset, random weights), {time.perf_counter() - started:.0f} s. Load generator and "
        "server share the machine. Economics use DeepSeek-shaped list prices ($0.028 cache "
        "hit / $0.28 miss / $0.42 output per million tokens) and a placeholder "
        "$2/accelerator-hour: on a CPU demo model the margin is meaningless, the arithmetic is "
        "what is shown.",
        "",
        "**Request-rate sweep** - `random`, 64 requests x 128 -> 32 tokens, Poisson arrivals, "
        "fresh prompts at each rate (columns: requests/s; goodput: TTFT <= 200 ms and "
        "TPOT <= 50 ms):",
        "",
        sweep_table,
        "",
        f"![latency vs throughput](img/{PLOT.name})",
        "",
        "**Multi-turn** - 8 users x 4 turns, a 256-token system prompt per user, 32-token "
        "user turns, 16-token answers, each turn resending the conversation; 8 users at once. "
        f"Input-cache hit rate **{multi['cache_hit_rate']:.1%}** (from `usage`) vs the "
        f"workload's oracle **{multi['oracle_hit_rate']:.1%}** "
        f"(= {multi['cache_hit_rate'] / multi['oracle_hit_rate']:.2f} of it):",
        "",
        turns_table.strip(),
    ])
    print(report)
    write_section(Path(args.output), SECTION, report)


if __name__ == "__main__":
    main()
