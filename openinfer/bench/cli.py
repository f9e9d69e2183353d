"""`openinfer bench serve` (load an OpenAI-compatible endpoint) and `openinfer bench compare`."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import sys
from dataclasses import asdict, fields, replace
from pathlib import Path

from openinfer.bench.metrics import Prices, economics, summarize
from openinfer.bench.report import columns_of, plot, table
from openinfer.bench.runner import RunConfig, run_workload
from openinfer.bench.workloads import WORKLOADS, WorkloadError, WorkloadOptions, build_workload


def add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark a running OpenAI-compatible server")
    commands = bench.add_subparsers(dest="bench_command", required=True)

    serve = commands.add_parser("serve", help="send a workload to a server and measure it")
    serve.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    serve.add_argument("--model", required=True, help="the served model name")
    serve.add_argument("--tokenizer", help="tokenizer path or name (default: --model)")
    serve.add_argument("--workload", choices=WORKLOADS, default="random")
    serve.add_argument("--dataset", help="sharegpt: a ShareGPT JSON file; replay: a Mooncake "
                                         "JSONL trace (timestamp ms, input_length, output_length, "
                                         "hash_ids)")
    serve.add_argument("--num-requests", type=int, default=100)
    serve.add_argument("--input-len", type=int, default=256)
    serve.add_argument("--output-len", type=int, default=128)
    serve.add_argument("--range-ratio", type=float, default=0.0,
                       help="lengths uniform in [len*(1-r), len*(1+r)]")
    serve.add_argument("--prefix-len", type=int, default=512,
                       help="shared-prefix / multi-turn: system prompt tokens")
    serve.add_argument("--num-groups", type=int, default=4)
    serve.add_argument("--prompts-per-group", type=int, default=8)
    serve.add_argument("--num-users", type=int, default=8)
    serve.add_argument("--num-turns", type=int, default=4)
    serve.add_argument("--shared-system-prompt", action="store_true",
                       help="multi-turn: all users share one system prompt")
    serve.add_argument("--think-time", type=float, default=0.0, help="seconds between turns")
    serve.add_argument("--replay-block-size", type=int, default=512)
    serve.add_argument("--request-rate", default="inf",
                       help="sessions/s; a comma list sweeps (e.g. 1,2,4,inf)")
    serve.add_argument("--arrival", choices=("poisson", "fixed"), default="poisson")
    serve.add_argument("--concurrency", type=int, help="most sessions in flight (closed loop)")
    serve.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                       help="do not send ignore_eos/min_tokens (servers that reject them)")
    serve.add_argument("--slo", help="goodput SLOs in ms, e.g. ttft=500,tpot=50,e2e=10000")
    serve.add_argument("--accelerator-hour-cost", type=float, default=2.0,
                       help="USD per accelerator-hour")
    serve.add_argument("--num-accelerators", type=int, default=1)
    serve.add_argument("--price", help="USD per million tokens, e.g. "
                                       "input_cache_hit=0.028,input_cache_miss=0.28,output=0.42")
    serve.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    serve.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--output", help="write the results (JSON) here")
    serve.add_argument("--no-progress", dest="progress", action="store_false")

    compare = commands.add_parser("compare", help="print results side by side")
    compare.add_argument("results", nargs="+", help="result JSON files of `bench serve`")
    compare.add_argument("--markdown", action="store_true")
    compare.add_argument("--plot", help="draw latency/throughput curves to this PNG")


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "compare":
        print(table(columns_of(args.results), markdown=args.markdown))
        if args.plot:
            plot(args.results, args.plot)
            print(f"plot written to {args.plot}")
        return 0
    try:
        return asyncio.run(_serve(args))
    except WorkloadError as e:
        print(f"openinfer bench: {e}", file=sys.stderr)
        return 2


async def _serve(args: argparse.Namespace) -> int:
    rates = _rates(args.request_rate)
    slo = _key_values(args.slo, {"ttft", "tpot", "e2e"}, "--slo")
    prices = Prices(**_key_values(args.price, {f.name for f in fields(Prices)}, "--price"))
    tokenizer = _load_tokenizer(args.tokenizer or args.model)
    options = WorkloadOptions(
        num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, prefix_len=args.prefix_len, num_groups=args.num_groups,
        prompts_per_group=args.prompts_per_group, num_users=args.num_users,
        num_turns=args.num_turns, shared_system_prompt=args.shared_system_prompt,
        think_time_s=args.think_time, dataset=args.dataset,
        replay_block_size=args.replay_block_size, seed=args.seed)
    workload = build_workload(args.workload, options, tokenizer)  # fails early if it cannot
    result = {"tool": "openinfer bench serve", "date": dt.datetime.now().isoformat(timespec="seconds"),
              "base_url": args.base_url, "model": args.model, "workload": args.workload,
              "workload_options": workload.options, "runs": []}
    failed = 0
    for i, rate in enumerate(rates):
        if i:  # fresh prompts: a sweep point must not hit the cache an earlier point filled
            workload = build_workload(args.workload, replace(options, seed=args.seed + i),
                                      tokenizer)
        config = RunConfig(base_url=args.base_url, model=args.model, request_rate=rate,
                           arrival=args.arrival, concurrency=args.concurrency,
                           ignore_eos=args.ignore_eos, api_key=args.api_key,
                           timeout_s=args.timeout, seed=args.seed, progress=args.progress)
        results, duration = await run_workload(config, workload, tokenizer)
        summary = summarize(results, duration, slo or None)
        run = {"request_rate": "inf" if math.isinf(rate) else rate,
               "concurrency": args.concurrency, "summary": summary,
               "economics": economics(summary, prices, args.accelerator_hour_cost,
                                      args.num_accelerators),
               "requests": [{**asdict(r), "tpot_s": r.tpot_s} for r in results]}
        result["runs"].append(run)
        failed += summary["failed"]
        if args.output:  # after every run, so a sweep that breaks keeps what it measured
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            Path(args.output).write_text(json.dumps(result, indent=1))
        for error in summary["errors"]:
            print(f"error: {error}", file=sys.stderr)
    print(table([(f"rate={run['request_rate']}", run) for run in result["runs"]]))
    if failed:
        print(f"openinfer bench: {failed} request(s) failed"
              + (f"; results saved to {args.output}" if args.output else ""), file=sys.stderr)
        return 1
    return 0


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",")]
    except ValueError as e:
        raise WorkloadError(f"--request-rate: not a number list: {text!r}") from e
    if any(r <= 0 for r in rates):
        raise WorkloadError("--request-rate values must be > 0 (inf for all at once)")
    return rates


def _key_values(text: str | None, allowed: set[str], flag: str) -> dict[str, float]:
    if not text:
        return {}
    values = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in allowed:
            raise WorkloadError(f"{flag}: unknown key {key!r}; use {', '.join(sorted(allowed))}")
        try:
            values[key.strip()] = float(value)
        except ValueError as e:
            raise WorkloadError(f"{flag}: {key}={value!r} is not a number") from e
    return values


def _load_tokenizer(name: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as e:  # a served name that is not a tokenizer path
        raise WorkloadError(f"cannot load a tokenizer from {name!r} ({type(e).__name__}); "
                            "pass --tokenizer PATH") from e
