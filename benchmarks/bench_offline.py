"""Offline benchmark: openinfer next to Hugging Face transformers, against the machine's limits.

What it measures, all in one run so that every figure has its baseline beside it:

1. Machine limits. float32 matmul rate (GFLOP/s) of `torch.mm` at the model's GEMM shapes and a
   square 2048^3, with torch's default thread count; the best shape is the compute limit. Memory
   bandwidth as BYTES READ per second of a large `dst.copy_(src)` (read+write traffic is twice
   that): a decode step streams every weight once, so bytes read is the quantity that bounds it.
2. Offline throughput: 32 prompts x 256 random input tokens x 128 greedy output tokens
   (ignore_eos) through `openinfer.LLM.generate`, and through transformers'
   `AutoModelForCausalLM.generate` batched on the same prompts (all of one length: no padding).
   Total and output tokens/s, their ratio, and total tokens/s as a fraction of the compute limit
   = matmul FLOP/s / (2 x matmul parameters), where matmul parameters are those of every Linear
   layer including the LM head, excluding the embedding table (a lookup, not a matmul). Also the
   number of prompts whose greedy tokens are identical in both engines.
3. Single request, 512 input / 128 output tokens: time to first token (TTFT) and decode tokens/s
   = 127 / (finish - first token). For transformers, TTFT is the time of a max_new_tokens=1
   generate and decode time is the full generate's time minus it. Decode tokens/s is compared with
   the bandwidth bound = bytes read per second / float32 bytes of the weights a decode step reads
   (all parameters except the embedding table, of which a step reads one row per sequence).
4. Peak memory (ru_maxrss) of the process that ran item 3, next to the float32 weight bytes.

How: the parent re-invokes this file once per measurement (`--worker NAME`), so the engines never
share a process, allocator state or peak RSS; each worker warms up with a short generate, times
one run and prints its result as JSON on the last line of stdout. The parent prints a table and
replaces the section between the bench_offline markers of docs/benchmarks.md.

    .venv/bin/python benchmarks/bench_offline.py            # full run (~8 min on 2 idle cores)
    .venv/bin/python benchmarks/bench_offline.py --quick    # tiny model, end to end in ~1 min

The CPUs may be shared: the report includes the CPU time other processes used during each phase,
and `--wait-quiet SECONDS` waits (up to SECONDS) for them to go quiet before each phase.

This file is the entry point and orchestration; its siblings hold the parts: offline_workload.py
(workload, model facts), offline_limits.py (machine limits, noise), offline_workers.py (the
measurements) and offline_report.py (derived figures, Markdown).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from doc_sections import write_section  # benchmarks/ is on sys.path when run as a script
from offline_limits import best_limits, children_cpu_seconds, cpu_busy_seconds, cpu_model, wait_until_quiet
from offline_report import RunInfo, derive, render
from offline_workers import WORKERS
from offline_workload import FULL, QUICK, Workload, model_facts

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = REPO / "docs" / "benchmarks.md"
QUICK_OUTPUT = REPO / ".cache" / "bench_offline_quick.md"
SECTION = "bench_offline"


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_worker(name: str, args: argparse.Namespace, label: str | None = None) -> dict:
    """Run this file as `--worker name` in a fresh process; its stdout's last line is the JSON."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--model", args.model]
    if args.quick:
        cmd.append("--quick")
    if args.profile_dir:
        cmd += ["--profile-dir", args.profile_dir]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    start, busy, ours = time.perf_counter(), cpu_busy_seconds(), children_cpu_seconds()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"worker {name} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    wall = time.perf_counter() - start
    # CPU time the machine spent busy beyond our worker's own: other processes' load.
    others = max(0.0, (cpu_busy_seconds() - busy) - (children_cpu_seconds() - ours)) / wall
    result["phase"] = {"wall_s": wall, "other_cores": others}
    log(f"{label or name}: done in {wall:.1f} s (other processes used {others:.2f} cores meanwhile)")
    return result


# --------------------------------------------------------------------------- main


def ensure_model(args: argparse.Namespace, wl: Workload) -> None:
    if args.model is None:
        args.model = str(REPO / ".cache" / wl.preset)
        # demo_spec.json is the builder's last file: its presence means a complete checkpoint.
        if not (Path(args.model) / "demo_spec.json").is_file():
            log(f"building the {wl.preset} demo model into {args.model}")
            run_worker("build", args)
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: no config.json there")


def run_all(args: argparse.Namespace, wl: Workload) -> dict[str, dict]:
    """Every phase in its own process, keyed by label; limits are measured first and last."""
    phases = [("limits", "limits"), ("openinfer-throughput", "openinfer-throughput")]
    if not args.skip_hf:
        phases.append(("hf-throughput", "hf-throughput"))
    phases.append(("openinfer-latency", "openinfer-latency"))
    if not args.skip_hf:
        phases.append(("hf-latency", "hf-latency"))
    phases.append(("limits (end)", "limits"))
    results = {}
    for i, (label, worker) in enumerate(phases, 1):
        if args.wait_quiet:
            waited = wait_until_quiet(args.wait_quiet)
            if waited > 3:
                log(f"waited {waited:.0f} s for other processes to leave the CPUs")
        log(f"phase {i}/{len(phases)}: {label}")
        results[label] = run_worker(worker, args, label)
    return results


def main_parent(args: argparse.Namespace) -> None:
    wl = QUICK if args.quick else FULL
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    ensure_model(args, wl)
    facts = model_facts(Path(args.model))
    results = run_all(args, wl)
    limits = best_limits([results["limits"], results["limits (end)"]])
    fig = derive(wl, facts, limits, results)
    info = RunInfo(
        date=dt.datetime.now().strftime("%Y-%m-%d %H:%M"), nproc=os.cpu_count() or 0, cpu=cpu_model(),
        torch_version=limits["torch_version"], threads=limits["threads"], load_before=load_before,
        load_after=os.getloadavg()[0], duration_s=time.perf_counter() - started, quick=args.quick,
        command=" ".join(["benchmarks/bench_offline.py", *sys.argv[1:]]),
    )
    report = render(info, facts, fig, wl, results)
    print(report)
    output = Path(args.output) if args.output else (QUICK_OUTPUT if args.quick else DEFAULT_OUTPUT)
    write_section(output, SECTION, report)
    if args.json:
        Path(args.json).write_text(json.dumps({"figures": asdict(fig), "facts": asdict(facts),
                                               "info": asdict(info)}, indent=2) + "\n")
    log(f"wrote {output} ({info.duration_s:.0f} s in all)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: build the bench-0.3b demo "
                        "preset into .cache/bench-0.3b, or the tiny preset with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, 4 prompts x 32/16 tokens: an end-to-end check in ~1 min")
    parser.add_argument("--output", help="Markdown file to update (default: "
                        f"{DEFAULT_OUTPUT.relative_to(REPO)}; {QUICK_OUTPUT.relative_to(REPO)} with --quick)")
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--json", help="also write the figures as JSON here")
    parser.add_argument("--profile-dir", help="cProfile each worker's timed section into DIR/NAME.prof")
    parser.add_argument("--wait-quiet", type=float, default=0, metavar="SECONDS",
                        help="before each phase, wait up to SECONDS for other processes to use "
                        "under 0.2 cores (for shared machines)")
    parser.add_argument("--threads", type=int, help="torch threads in the workers (default: torch's)")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.worker:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        result = WORKERS[args.worker](args, QUICK if args.quick else FULL)
        print(json.dumps(result))
    else:
        main_parent(args)


if __name__ == "__main__":
    main()
