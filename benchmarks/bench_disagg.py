"""Prefill/decode disaggregation benchmark (bench-0.3b demo model, this machine).

1. Interference. Four short requests decode back to back (32-token prompts, 32-token
   answers, a closed loop) while three long prompts (1024 tokens, 8-token answers) arrive
   10 s apart. Colocated: one `openinfer serve` with both cores (OMP_NUM_THREADS=2).
   The same with 256-token steps (--max-num-batched-tokens 256: a long prompt is
   prefilled in chunks between decode steps, the usual remedy without disaggregation).
   Disaggregated: `--role prefill` and `--role decode` instances with one core each
   (OMP_NUM_THREADS=1) behind `openinfer router --prefill --decode`. Reported: ITL and
   TTFT p50/p99 of the short requests, TTFT of the long ones, and goodput under the SLO
   below (requests per second meeting it).
2. KV transfer. Two in-process engines; per connector, prompts of 1024 tokens are
   prefilled on one and pulled by the other: transfer throughput and per-request
   transfer latency beside the time to recompute the same prefill.

    .venv/bin/python benchmarks/bench_disagg.py
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_server import ensure_demo_model, start_cli  # benchmarks/ is on sys.path as a script
from doc_sections import write_section

from openinfer.bench.client import RequestResult, stream_request

REPO = Path(__file__).resolve().parent.parent
SECTION = "bench_disagg"
SLO = {"short": {"ttft_ms": 2000, "max_itl_ms": 2000}, "long": {"ttft_ms": 15000}}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


# ---- 1. interference -------------------------------------------------------------------

async def timed_stream(http: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    # Chunks, not text, time the tokens: the demo model's vocabulary is padded past its
    # tokenizer's, so many of its tokens decode to nothing.
    return await stream_request(http, url, body, RequestResult(0, 0, 0.0), time.perf_counter(),
                                count_empty_chunks=True)


async def mixed_load(base: str, args, seed: int = 0) -> dict:
    rng = random.Random(seed)
    url = f"{base}/v1/completions"
    zero = time.perf_counter()
    short: list[RequestResult] = []
    long: list[RequestResult] = []
    done = asyncio.Event()

    def body(prompt_len: int, max_tokens: int) -> dict:
        return {"model": "bench", "prompt": [rng.randrange(10, 8000) for _ in range(prompt_len)],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}

    async with httpx.AsyncClient(timeout=None) as http:
        async def short_loop() -> None:
            while not done.is_set():
                short.append(await timed_stream(http, url, body(args.short_len, args.short_len)))

        async def long_one(delay: float) -> None:
            await asyncio.sleep(delay)
            long.append(await timed_stream(http, url, body(args.long_len, 8)))

        loops = [asyncio.create_task(short_loop()) for _ in range(args.num_short)]
        await asyncio.gather(*(long_one(3.0 + i * args.long_every) for i in range(args.num_long)))
        done.set()
        await asyncio.gather(*loops)
    duration = time.perf_counter() - zero
    itl = [x for r in short if r.ok for x in r.itl_s]
    good_short = [r for r in short if r.ok and r.ttft_s * 1000 <= SLO["short"]["ttft_ms"]
                  and max(r.itl_s or [0]) * 1000 <= SLO["short"]["max_itl_ms"]]
    good_long = [r for r in long if r.ok and r.ttft_s * 1000 <= SLO["long"]["ttft_ms"]]
    return {
        "duration_s": duration, "failed": [r.error for r in short + long if not r.ok],
        "short_done": sum(r.ok for r in short),
        "itl_p50": _pct(itl, 50), "itl_p99": _pct(itl, 99), "itl_max": max(itl, default=0),
        "short_ttft_p50": _pct([r.ttft_s for r in short if r.ok], 50),
        "short_ttft_p99": _pct([r.ttft_s for r in short if r.ok], 99),
        "long_ttft_p50": _pct([r.ttft_s for r in long if r.ok], 50),
        "long_ttft_max": max((r.ttft_s for r in long if r.ok), default=float("nan")),
        "goodput": (len(good_short) + len(good_long)) / duration,
        "good_short": len(good_short), "good_long": len(good_long),
    }


def run_interference(model: str, args) -> dict[str, dict]:
    results = {}
    one_core = {**os.environ, "OMP_NUM_THREADS": "1"}
    two_cores = {**os.environ, "OMP_NUM_THREADS": "2"}
    for name, flags in (("colocated (1 instance, 2 threads)", []),
                        ("colocated, 256-token steps (chunked prefill)",
                         ["--max-num-batched-tokens", "256"])):
        base, proc = start_cli(["serve", "--model", model, "--served-model-name", "bench",
                                *flags], env=two_cores)
        try:
            results[name] = asyncio.run(mixed_load(base, args))
        finally:
            _stop([proc])
    procs = []
    try:
        prefill, p = start_cli(["serve", "--model", model, "--served-model-name", "bench",
                                "--role", "prefill"], env=one_core)
        procs.append(p)
        decode, d = start_cli(["serve", "--model", model, "--served-model-name", "bench",
                               "--role", "decode"], env=one_core)
        procs.append(d)
        router, r = start_cli(["router", "--tokenizer", model, "--decode", decode, "--prefill",
                               prefill, "--disagg-min-tokens", "512"], env=one_core)
        procs.append(r)
        results["disaggregated (1P + 1D, 1 thread each)"] = asyncio.run(mixed_load(router, args))
    finally:
        _stop(procs)
    return results


def _stop(procs) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=60)


# ---- 2. transfer -----------------------------------------------------------------------

def run_transfer(model: str, num_prompts: int, prompt_len: int) -> dict[str, dict]:
    from openinfer import LLM, SamplingParams

    rng = random.Random(1)
    results = {}
    with tempfile.TemporaryDirectory() as store:
        for connector in ("tcp", "shm", "file"):
            shared = {"kv_store_dir": store} if connector == "file" else {}
            prefill = LLM(model, kv_role="prefill", progress=False, **shared)
            decode = LLM(model, kv_role="decode", kv_connector=connector, progress=False,
                         **shared)
            # The first pull of a connector also sets it up (shm: maps a segment, faulting
            # its pages in on both sides): it is run, and reported apart.
            prompts = [[rng.randrange(10, 8000) for _ in range(prompt_len)]
                       for _ in range(num_prompts + 1)]
            recompute, params = [], []
            for prompt in prompts:
                start = time.perf_counter()
                out = prefill.generate([prompt], SamplingParams(
                    max_tokens=1, kv_transfer_params={"do_remote_decode": True}))[0]
                recompute.append(time.perf_counter() - start)
                params.append(out.kv_transfer_params)
            prefill.engine.core.drain_file_io()  # (file) the writes a puller would wait for
            latency = []
            stats = decode.engine.core.executor.worker.mover.stats
            direction = "store_to_host" if connector == "file" else "remote_to_host"
            for prompt, p in zip(prompts, params):
                before_s, before_b = stats.seconds[direction], stats.bytes[direction]
                decode.generate([prompt], SamplingParams(max_tokens=1, kv_transfer_params=p))
                latency.append((stats.seconds[direction] - before_s,
                                stats.bytes[direction] - before_b))
            first, latency = latency[0], latency[1:]
            seconds = sum(s for s, _ in latency)
            moved = sum(b for _, b in latency)
            results[connector] = {
                "bytes_per_request": moved / num_prompts,
                "gbps": moved / seconds / 1e9 if seconds else float("nan"),
                "latency_ms": 1000 * statistics.median(s for s, _ in latency),
                "first_ms": 1000 * first[0],
                "recompute_ms": 1000 * statistics.median(recompute),
                "failures": stats.remote_pull_failures,
            }
            for llm in (prefill, decode):
                llm.engine.core.shutdown()
            del prefill, decode
    return results


# ---- report ----------------------------------------------------------------------------

def report(interference: dict[str, dict], transfer: dict[str, dict], args) -> str:
    colo, chunked, disagg = list(interference.values())
    lines = [
        "## Prefill/decode disaggregation (`benchmarks/bench_disagg.py`)",
        "",
        f"bench-0.3b demo model on this machine's 2 CPU cores, {dt.date.today()}.",
        "",
        f"**Interference.** {args.num_short} short requests ({args.short_len}-token prompt and "
        f"answer) decode in a closed loop while {args.num_long} long prompts "
        f"({args.long_len} tokens, 8-token answer) arrive {args.long_every:.0f} s apart. "
        "SLO: short TTFT <= "
        f"{SLO['short']['ttft_ms'] / 1000:.0f} s and no gap between its tokens > "
        f"{SLO['short']['max_itl_ms'] / 1000:.0f} s; long TTFT <= "
        f"{SLO['long']['ttft_ms'] / 1000:.0f} s.",
        "",
        "| setup | short ITL p50 / p99 / max (ms) | short TTFT p50 / p99 (ms) "
        "| long TTFT p50 / max (ms) | short done (within SLO) | long within SLO | goodput (req/s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in interference.items():
        lines.append(
            f"| {name} | {1000 * r['itl_p50']:.0f} / {1000 * r['itl_p99']:.0f} / "
            f"{1000 * r['itl_max']:.0f} | {1000 * r['short_ttft_p50']:.0f} / "
            f"{1000 * r['short_ttft_p99']:.0f} | {1000 * r['long_ttft_p50']:.0f} / "
            f"{1000 * r['long_ttft_max']:.0f} | {r['short_done']} ({r['good_short']}) | "
            f"{r['good_long']}/{args.num_long} | {r['goodput']:.3f} |")
    lines += [
        "",
        f"Ratios disaggregated / colocated: short ITL p99 "
        f"{disagg['itl_p99'] / colo['itl_p99']:.2f}, ITL max {disagg['itl_max'] / colo['itl_max']:.2f}, "
        f"long TTFT p50 {disagg['long_ttft_p50'] / colo['long_ttft_p50']:.2f}, goodput "
        f"{disagg['goodput'] / colo['goodput']:.2f}; against 256-token steps: short ITL p99 "
        f"{disagg['itl_p99'] / chunked['itl_p99']:.2f}, long TTFT p50 "
        f"{disagg['long_ttft_p50'] / chunked['long_ttft_p50']:.2f}, goodput "
        f"{disagg['goodput'] / chunked['goodput']:.2f}. Failed requests: "
        f"{sum(len(r['failed']) for r in interference.values())}.",
        "",
        "Why: colocated, a long prompt's prefill is one engine step (the 2048-token step "
        "budget takes a 1024-token prompt whole; its TTFT p50 here: "
        f"{1000 * colo['long_ttft_p50']:.0f} ms), and every running decode waits for it: that "
        "step sets the short requests' ITL max, and breaks their SLO when it outlasts it. "
        "Disaggregated, the prefill runs in another process on the other core while decode "
        "steps go on; the price on two cores is that each role has one core instead of two, "
        "so decode steps are slower at the median and the long prompts' TTFT grows (one core "
        "for their prefill, plus the transfer). With an accelerator per role that halving does "
        "not happen; here it is the cost of splitting one small machine, and where the "
        "colocated stall stays under the SLO (a CPU fast enough for this prompt length) "
        "disaggregation only pays that cost. Smaller steps (chunked prefill) are the colocated "
        "remedy: they bound each stall to one chunk, at the cost of more steps per prompt.",
        "",
        f"**KV transfer** ({args.prompt_len}-token prompts, median of {args.num_prompts} after "
        "a first pull reported apart; latency is the pull's wall time on the decode side, "
        "recompute the prefill's; both engines in one process, so shm and tcp cross no "
        "process boundary here but do all their copies and checksums):",
        "",
        "| connector | MiB per request | GB/s | transfer latency (ms) | first pull (ms) "
        "| recompute (ms) | transfer / recompute |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in transfer.items():
        lines.append(f"| {name} | {r['bytes_per_request'] / 2**20:.0f} | {r['gbps']:.2f} | "
                     f"{r['latency_ms']:.1f} | {r['first_ms']:.1f} | {r['recompute_ms']:.0f} | "
                     f"{r['latency_ms'] / r['recompute_ms']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--num-short", type=int, default=4)
    parser.add_argument("--short-len", type=int, default=32)
    parser.add_argument("--num-long", type=int, default=3)
    parser.add_argument("--long-len", type=int, default=1024)
    parser.add_argument("--long-every", type=float, default=10.0)
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--out", default=str(REPO / "docs" / "benchmarks.md"))
    args = parser.parse_args()
    model = ensure_demo_model(args.model, "bench-0.3b")
    transfer = run_transfer(model, args.num_prompts, args.prompt_len)
    print(transfer, file=sys.stderr)
    interference = run_interference(model, args)
    print(interference, file=sys.stderr)
    text = report(interference, transfer, args)
    print(text)
    write_section(Path(args.out), SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
