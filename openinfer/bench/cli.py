"""`openinfer bench serve` (load an OpenAI-compatible endpoint) and `openinfer bench compare`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from openinfer.bench import BenchError
from openinfer.bench.client import first_served_model
from openinfer.bench.metrics import Prices, economics, summarize
from openinfer.bench.report import columns_of, plot, table
from openinfer.bench.runner import RunConfig, run_workload
from openinfer.bench.tokenizer import BenchTokenizer, LocalTokenizer, ServerTokenizer
from openinfer.bench.vllm_result import vllm_file_name, vllm_result
from openinfer.bench.workloads import WORKLOADS, WorkloadError, WorkloadOptions, build_workload


def add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark a running OpenAI-compatible server")
    commands = bench.add_subparsers(dest="bench_command", required=True)

    serve = commands.add_parser("serve", help="send a workload to a server and measure it")
    serve.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    serve.add_argument("--model", help="the served model name (default: the first model the "
                                       "server's /v1/models lists)")
    serve.add_argument("--tokenizer", help="a local tokenizer: path or hub name (default: the "
                                           "server's /tokenize and /detokenize)")
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
                       help="shared-prefix / multi-turn / agentic: system prompt tokens")
    serve.add_argument("--num-groups", type=int, default=4)
    serve.add_argument("--prompts-per-group", type=int, default=8)
    serve.add_argument("--num-users", type=int, default=8)
    serve.add_argument("--num-turns", type=int, default=4)
    serve.add_argument("--shared-system-prompt", action="store_true",
                       help="multi-turn: all users share one system prompt")
    serve.add_argument("--think-time", type=float, default=0.0, help="seconds between turns")
    serve.add_argument("--replay-block-size", type=int, default=512)
    serve.add_argument("--tool-time", type=float, default=2.0,
                       help="agentic: mean seconds a tool runs before its result is sent "
                            "(exponential)")
    serve.add_argument("--abandon-rate", type=float, default=0.1,
                       help="agentic: share of sessions that stop after a random turn")
    serve.add_argument("--request-rate", default="inf",
                       help="sessions/s; a comma list sweeps (e.g. 1,2,4,inf)")
    serve.add_argument("--arrival", choices=("poisson", "fixed"), default="poisson")
    serve.add_argument("--concurrency", type=int, help="most sessions in flight (closed loop)")
    serve.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                       help="do not send ignore_eos/min_tokens (servers that reject them)")
    serve.add_argument("--slo", help="goodput SLOs in ms, e.g. ttft=500,tpot=50,e2e=10000")
    serve.add_argument("--accelerator-hour-cost", type=float,
                       help="USD per accelerator-hour of the hardware measured; without it "
                            "no cost or margin is reported (revenue is, at --price)")
    serve.add_argument("--num-accelerators", type=int, default=1)
    serve.add_argument("--price", help="USD per million tokens, e.g. "
                                       "input_cache_hit=0.028,input_cache_miss=0.28,output=0.42")
    serve.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    serve.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--output", help="write the results here (format: --save-result)")
    serve.add_argument("--save-result", choices=("openinfer", "vllm"),
                       help="save the results: openinfer (default; every run and request in "
                            "one file, what `bench compare` reads) or vllm (the flat JSON of "
                            "`vllm bench serve --save-result`, one object per request rate); "
                            "to --output, else into --result-dir")
    serve.add_argument("--result-dir", help="with --save-result: the directory (default: .)")
    serve.add_argument("--result-filename",
                       help="with --save-result: the file name (default: vLLM's "
                            "{backend}-{rate}qps[-concurrency{N}]-{model}-{date}.json for vllm, "
                            "one file per rate; openinfer-{workload}-{model}-{date}.json)")
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
    except BenchError as e:
        print(f"openinfer bench: {e}", file=sys.stderr)
        return 2


async def _serve(args: argparse.Namespace) -> int:
    rates = _rates(args.request_rate)
    slo = _key_values(args.slo, {"ttft", "tpot", "e2e"}, "--slo")
    prices = Prices(**_key_values(args.price, {f.name for f in fields(Prices)}, "--price"))
    if args.output and (args.result_dir or args.result_filename):
        raise BenchError("--output names the file, --result-dir/--result-filename build its "
                         "name: give one or the other")
    now = dt.datetime.now()
    model = args.model or first_served_model(args.base_url, args.api_key)
    saver = _Saver.plan(args, model, now)
    if args.tokenizer:
        opened = contextlib.nullcontext(LocalTokenizer.load(args.tokenizer))
    else:
        opened = ServerTokenizer(args.base_url, model, args.api_key)
    print(f"openinfer bench: model {model!r}{'' if args.model else ' (from /v1/models)'}, "
          f"tokenizer {args.tokenizer or 'of the server (/tokenize)'}", file=sys.stderr)
    with opened as tokenizer:
        return await _measure(args, model, tokenizer, rates, slo, prices, saver, now)


async def _measure(args: argparse.Namespace, model: str, tokenizer: BenchTokenizer,
                   rates: list[float], slo: dict[str, float], prices: Prices,
                   saver: _Saver | None, now: dt.datetime) -> int:
    """Build the workload, run it at every request rate, save and print the results."""
    options = WorkloadOptions(
        num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, prefix_len=args.prefix_len, num_groups=args.num_groups,
        prompts_per_group=args.prompts_per_group, num_users=args.num_users,
        num_turns=args.num_turns, shared_system_prompt=args.shared_system_prompt,
        think_time_s=args.think_time, dataset=args.dataset, tool_time_s=args.tool_time,
        abandon_rate=args.abandon_rate,
        replay_block_size=args.replay_block_size, seed=args.seed)
    workload = build_workload(args.workload, options, tokenizer)  # fails early if it cannot
    result = {"tool": "openinfer bench serve", "date": now.isoformat(timespec="seconds"),
              "base_url": args.base_url, "model": model, "tokenizer": tokenizer.name,
              "workload": args.workload, "workload_options": workload.options, "runs": []}
    failed = 0
    for i, rate in enumerate(rates):
        if i:  # fresh prompts: a sweep point must not hit the cache an earlier point filled
            workload = build_workload(args.workload, replace(options, seed=args.seed + i),
                                      tokenizer)
        config = RunConfig(base_url=args.base_url, model=model, request_rate=rate,
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
        if saver is not None:  # after every run, so a sweep that breaks keeps what it measured
            saver.save(result if saver.fmt == "openinfer" else vllm_result(
                results, duration, endpoint=workload.endpoint, model_id=model,
                tokenizer_id=args.tokenizer or model, request_rate=rate, arrival=args.arrival,
                max_concurrency=args.concurrency, goodput=summary["goodput"],
                date=now.strftime("%Y%m%d-%H%M%S")))
        for error in summary["errors"]:
            print(f"error: {error}", file=sys.stderr)
    print(table([(f"rate={run['request_rate']}", run) for run in result["runs"]]))
    saved = f"results saved to {', '.join(map(str, saver.written))}" if saver else ""
    if failed:
        print(f"openinfer bench: {failed} request(s) failed" + (f"; {saved}" if saved else ""),
              file=sys.stderr)
        return 1
    if saved:
        print(f"openinfer bench: {saved}", file=sys.stderr)
    return 0


@dataclass
class _Saver:
    """Where and how results are saved after each run.

    openinfer format: the whole result (every run so far) to ``path``. vllm format: one object
    per run; with a fixed ``path`` they are written one per line (what `vllm bench serve
    --append-result` makes; a single run is a plain JSON file), else each run gets vLLM's
    file name in ``directory``."""

    fmt: str
    path: Path | None
    directory: Path
    vllm_runs: list[dict]
    written: list[Path]

    @classmethod
    def plan(cls, args: argparse.Namespace, model: str, now: dt.datetime) -> _Saver | None:
        """None when nothing is to be saved (no --output, --save-result or --result-*)."""
        if not (args.output or args.save_result or args.result_dir or args.result_filename):
            return None
        fmt = args.save_result or "openinfer"
        directory = Path(args.result_dir or ".")
        if args.output:
            path = Path(args.output)
        elif args.result_filename:
            path = directory / args.result_filename
        elif fmt == "openinfer":
            stamp = now.strftime("%Y%m%d-%H%M%S")
            path = directory / f"openinfer-{args.workload}-{model.split('/')[-1]}-{stamp}.json"
        else:
            path = None
        return cls(fmt, path, directory, [], [])

    def save(self, run: dict) -> None:
        """Save after a run: openinfer format, the whole result so far; vllm, this run."""
        if self.fmt == "openinfer":
            self._write(self.path, json.dumps(run, indent=1))
            return
        self.vllm_runs.append(run)
        if self.path is None:
            self._write(self.directory / vllm_file_name(run), json.dumps(run))
        else:
            self._write(self.path, "\n".join(json.dumps(r) for r in self.vllm_runs) + "\n")

    def _write(self, path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if path not in self.written:
            self.written.append(path)


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
