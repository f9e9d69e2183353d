"""Router benchmark: cluster input-cache hit rate per policy vs one replica, load spread,
and router overhead. Demo model (tiny preset), 4 replicas on this machine.

1. `openinfer bench serve` multi-turn (32 users x 4 turns, a 256-token system prompt per
   user, 32-token turns, 8-token answers, 16 users at a time) straight to one replica, then
   through `openinfer router` over 4 replicas with each policy. Every replica's cache is
   reset between runs. Hit rate from `usage`, throughput, TTFT p50/p99, and the max/min
   ratio of requests per replica.
2. Router overhead: 50 sequential 1-token requests straight to a replica and through the
   router (p50 E2E, the difference is what the router adds), and the request rate of
   1-token requests at concurrency 32 both ways.

Replicas run with one torch thread each (OMP_NUM_THREADS=1): four engines share the
cores. Every figure is beside its baseline from the same run.

    .venv/bin/python benchmarks/bench_router.py
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import httpx
from bench_server import ensure_demo_model, start_cli  # benchmarks/ is on sys.path when run as a script
from doc_sections import write_section

REPO = Path(__file__).resolve().parent.parent
SECTION = "bench_router"
POLICIES = ("round_robin", "least_load", "power_of_two", "cache_aware")
WORKLOAD = ["--workload", "multi-turn", "--num-users", "32", "--num-turns", "4",
            "--prefix-len", "256", "--input-len", "32", "--output-len", "8",
            "--concurrency", "16"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

ADMIN_KEY = "bench-admin"  # the replicas' cache reset between runs needs it


def _start(args: list[str]) -> tuple[str, subprocess.Popen]:
    return start_cli(args, env={**os.environ, "OMP_NUM_THREADS": "1",
                                "OPENINFER_ADMIN_API_KEY": ADMIN_KEY})


def replica(model: str) -> tuple[str, subprocess.Popen]:
    return _start(["serve", "--model", model, "--served-model-name", "bench",
                   "--kv-events-endpoint", f"tcp://127.0.0.1:{_port()}",
                   "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{_port()}"])


def bench(base: str, model: str, out: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "openinfer.cli", "bench", "serve",
                           "--base-url", base, "--model", "bench", "--tokenizer", model,
                           "--no-progress", "--output", str(out), *WORKLOAD],
                          capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"bench failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())["runs"][0]["summary"]


def reset(urls: list[str]) -> None:
    for url in urls:
        urllib.request.urlopen(urllib.request.Request(
            f"{url}/v1/cache/reset", method="POST",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"}), timeout=60)


async def _one_token(client: httpx.AsyncClient, base: str, i: int) -> float:
    start = time.perf_counter()
    resp = await client.post(f"{base}/v1/completions", json={
        "model": "bench", "prompt": [5 + i % 50, 9, 11], "max_tokens": 1})
    resp.raise_for_status()
    return time.perf_counter() - start


async def overhead(base: str) -> tuple[float, float]:
    """(p50 E2E of sequential 1-token requests in s, requests/s at concurrency 32)."""
    async with httpx.AsyncClient(timeout=60) as client:
        for i in range(5):
            await _one_token(client, base, i)
        sequential = [await _one_token(client, base, i) for i in range(50)]
        start = time.perf_counter()
        pending = iter(range(256))

        async def loop() -> None:
            for i in pending:
                await _one_token(client, base, i)

        await asyncio.gather(*(loop() for _ in range(32)))
        rate = 256 / (time.perf_counter() - start)
    return statistics.median(sequential), rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint (default: the demo model, tiny preset)")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--output", default=str(REPO / "docs" / "benchmarks.md"))
    args = parser.parse_args()
    model = ensure_demo_model(args.model)
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench-router-"))
    replicas = [replica(model) for _ in range(args.replicas)]
    urls = [url for url, _ in replicas]
    results = {}
    try:
        print("[bench] one replica", file=sys.stderr, flush=True)
        results["one replica"] = (bench(urls[0], model, tmp / "single.json"), None)
        for policy in POLICIES:
            print(f"[bench] {policy}", file=sys.stderr, flush=True)
            reset(urls)
            router, proc = _start(["router", *[a for u in urls for a in ("--worker", u)],
                                   "--tokenizer", model, "--policy", policy])
            try:
                time.sleep(1.0)  # event subscriptions
                summary = bench(router, model, tmp / f"{policy}.json")
                request = urllib.request.Request(f"{router}/admin/workers",
                                                 headers={"Authorization": f"Bearer {ADMIN_KEY}"})
                workers = json.loads(urllib.request.urlopen(request).read())
                results[policy] = (summary, [w["routed"] for w in workers["workers"]])
            finally:
                proc.terminate()
                proc.wait(timeout=60)
        print("[bench] router overhead", file=sys.stderr, flush=True)
        direct = asyncio.run(overhead(urls[0]))
        router, proc = _start(["router", "--worker", urls[0], "--tokenizer", model])
        try:
            routed = asyncio.run(overhead(router))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    finally:
        for _, proc in replicas:
            proc.terminate()
        for _, proc in replicas:
            proc.wait(timeout=60)

    single = results["one replica"][0]["cache_hit_rate"]
    lines = [
        "## Router (`benchmarks/bench_router.py`)",
        "",
        f"{dt.datetime.now():%Y-%m-%d %H:%M}, {os.cpu_count()} cores shared by "
        f"{args.replicas} replicas of the demo model (tiny preset, one torch thread each), "
        f"{time.perf_counter() - started:.0f} s. Multi-turn: 32 users x 4 turns, a 256-token "
        "system prompt per user, 32-token turns, 8-token answers, 16 users at a time; caches "
        "reset between runs.",
        "",
        "| target | input-cache hit rate | vs one replica | total tokens/s | TTFT p50 / p99 (ms) "
        "| requests per replica | max/min |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (s, per_replica) in results.items():
        spread = "-" if per_replica is None else " / ".join(map(str, per_replica))
        ratio = "-" if per_replica is None else f"{max(per_replica) / max(1, min(per_replica)):.2f}"
        lines.append(f"| {name} | {s['cache_hit_rate']:.1%} | "
                     f"{s['cache_hit_rate'] / single:.2f} | {s['total_token_throughput']:.0f} | "
                     f"{s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p99']:.0f} | {spread} | "
                     f"{ratio} |")
    lines += [
        "",
        f"**Router overhead** (a fresh router in front of one replica, 1-token requests): p50 "
        f"E2E {direct[0] * 1000:.1f} ms direct vs {routed[0] * 1000:.1f} ms through the router "
        f"(+{(routed[0] - direct[0]) * 1000:.1f} ms); at concurrency 32, {direct[1]:.0f} "
        f"requests/s direct vs {routed[1]:.0f} through the router, which shares the two cores "
        "with the replicas.",
    ]
    report = "\n".join(lines)
    print(report)
    write_section(Path(args.output), SECTION, report)


if __name__ == "__main__":
    main()
