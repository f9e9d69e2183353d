"""Overload: arrivals at 3x what one server sustains, with --max-waiting-requests.

First the capacity: a closed loop of ``--concurrency`` clients finds the completed
requests per second. Then two open loops (Poisson arrivals, seeded) of the same requests:
at 0.8x that rate and at 3x. Refused requests must get a fast 503 with Retry-After, and
the admitted ones should keep their time to first token: the figures are the p50/p99 TTFT
of admitted requests at both rates, the share refused, and how long a refusal takes.

    .venv/bin/python benchmarks/overload.py [--max-waiting 8] [--seconds 60] [--no-write]

Figures go to docs/reliability.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx
from bench_server import ensure_demo_model, start_server
from doc_sections import write_section

REPO = Path(__file__).resolve().parent.parent
WORDS = ["cache", "block", "token", "prefix", "tier", "store", "decode", "prefill", "router"]


def body(i: int, max_tokens: int) -> dict:
    text = " ".join(random.Random(i).choices(WORDS, k=100))  # no shared prefix beyond chance
    return {"model": "bench", "prompt": f"{i} {text}", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}


async def one(http: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[str, float]:
    """("ok", TTFT) or ("503", time to the refusal) or (another outcome, seconds)."""
    start = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/completions", json=body(i, max_tokens)) as resp:
            if resp.status_code != 200:
                await resp.aread()
                took = time.perf_counter() - start
                if resp.status_code == 503 and resp.headers.get("retry-after"):
                    return "503", took
                return str(resp.status_code), took
            ttft = None
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if "error" in json.loads(line[6:]):
                    print(f"request {i}: {line[:300]}", flush=True)
                    return "error event", time.perf_counter() - start
                if ttft is None:
                    ttft = time.perf_counter() - start
            return "ok", ttft
    except httpx.HTTPError as e:
        return type(e).__name__, time.perf_counter() - start


async def capacity(base: str, concurrency: int, seconds: float, max_tokens: int) -> float:
    """Completed requests per second with ``concurrency`` clients always waiting."""
    done, stop = 0, time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        async def client(c: int) -> None:
            nonlocal done
            i = c
            while time.monotonic() < stop:
                outcome, _ = await one(http, 10_000_000 + i, max_tokens)
                assert outcome == "ok", outcome
                done += 1
                i += concurrency
        start = time.monotonic()
        await asyncio.gather(*(client(c) for c in range(concurrency)))
        return done / (time.monotonic() - start)


async def open_loop(base: str, rate: float, seconds: float, max_tokens: int,
                    seed: int) -> list[tuple[str, float]]:
    rng = random.Random(seed)
    tasks = []
    async with httpx.AsyncClient(base_url=base, timeout=600,
                                 limits=httpx.Limits(max_connections=None)) as http:
        start = time.monotonic()
        arrival, i = 0.0, 0
        while arrival < seconds:
            await asyncio.sleep(max(0.0, start + arrival - time.monotonic()))
            tasks.append(asyncio.create_task(one(http, seed * 1_000_000 + i, max_tokens)))
            arrival += rng.expovariate(rate)
            i += 1
        return await asyncio.gather(*tasks)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summary(results: list[tuple[str, float]]) -> dict:
    ttft = [t for outcome, t in results if outcome == "ok"]
    refused = [t for outcome, t in results if outcome == "503"]
    other = [outcome for outcome, _ in results if outcome not in ("ok", "503")]
    return {"sent": len(results), "admitted": len(ttft), "refused": len(refused),
            "other": other, "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99),
            "refusal_p99": pct(refused, 0.99),
            "refusal_mean": statistics.fmean(refused) if refused else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint (default: the demo model)")
    parser.add_argument("--max-waiting", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    model = ensure_demo_model(args.model)
    base, proc = start_server(model, "--max-waiting-requests", str(args.max_waiting),
                              "--max-num-seqs", str(args.concurrency))
    try:
        asyncio.run(capacity(base, args.concurrency, 5, args.max_tokens))  # warm-up
        rate = asyncio.run(capacity(base, args.concurrency, args.seconds / 2, args.max_tokens))
        print(f"capacity {rate:.2f} requests/s", flush=True)
        runs = {}
        for name, factor in (("0.8x", 0.8), ("3x", 3.0)):
            runs[name] = summary(asyncio.run(open_loop(base, rate * factor, args.seconds,
                                                       args.max_tokens, seed=int(factor * 10))))
            print(name, runs[name], flush=True)
    finally:
        proc.terminate()
        proc.wait()
    lines = [
        f"Demo model, prompts of about 110 tokens, {args.max_tokens} tokens out (streamed), "
        f"`--max-num-seqs {args.concurrency} --max-waiting-requests {args.max_waiting}`; "
        f"capacity measured with {args.concurrency} clients always waiting: "
        f"**{rate:.2f} requests/s**. Then Poisson arrivals for {args.seconds:.0f} s at each "
        "rate below.", "",
        "| arrivals | sent | admitted | refused (503 + Retry-After) | other outcomes "
        "| admitted TTFT p50 / p99 | refusal time mean / p99 |",
        "|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        lines.append(
            f"| {name} capacity | {r['sent']} | {r['admitted']} | {r['refused']} "
            f"| {len(r['other'])} | {r['ttft_p50'] * 1e3:.0f} / {r['ttft_p99'] * 1e3:.0f} ms "
            f"| {r['refusal_mean'] * 1e3:.1f} / {r['refusal_p99'] * 1e3:.1f} ms |")
    base_p99, over_p99 = runs["0.8x"]["ttft_p99"], runs["3x"]["ttft_p99"]
    lines += ["", f"Admitted requests' p99 TTFT under 3x overload is {over_p99 / base_p99:.2f}x "
              "the p99 at 0.8x capacity (the bound is the waiting queue: at most "
              f"{args.max_waiting} requests wait behind the {args.concurrency} running)."]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section(REPO / "docs" / "reliability.md", "overload", text)


if __name__ == "__main__":
    main()
