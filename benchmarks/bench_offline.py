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
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import json
import os
import platform
import random
import resource
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from doc_sections import write_section  # benchmarks/ is on sys.path when run as a script

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = REPO / "docs" / "benchmarks.md"
QUICK_OUTPUT = REPO / ".cache" / "bench_offline_quick.md"
SECTION = "bench_offline"

GOAL_THROUGHPUT_VS_HF = 1.5
GOAL_COMPUTE_FRACTION = 0.7
GOAL_BANDWIDTH_FRACTION = 0.6

GiB = 1024**3


@dataclass(frozen=True)
class Workload:
    preset: str
    """Demo preset built when --model is not given."""
    num_prompts: int
    prompt_len: int
    output_len: int
    latency_prompt_len: int
    latency_output_len: int
    matmul_shapes: tuple[tuple[int, int, int], ...]
    """(M, K, N): [M x K] @ [K x N]."""
    prefill_gemm: tuple[int, int, int]
    """The one of matmul_shapes that stands for a prefill step's GEMMs."""
    decode_gemm: tuple[int, int, int]
    """The one that stands for a decode step's GEMMs (M = the batch of decoding sequences)."""
    matmul_seconds: float
    copy_bytes: int
    seed: int = 0


FULL = Workload(
    preset="bench-0.3b", num_prompts=32, prompt_len=256, output_len=128,
    latency_prompt_len=512, latency_output_len=128,
    matmul_shapes=((2048, 2048, 2048), (2048, 1024, 3072), (256, 1024, 3072), (32, 1024, 3072)),
    prefill_gemm=(2048, 1024, 3072), decode_gemm=(32, 1024, 3072),
    matmul_seconds=2.0, copy_bytes=GiB,
)
QUICK = Workload(
    preset="tiny", num_prompts=4, prompt_len=32, output_len=16,
    latency_prompt_len=32, latency_output_len=16,
    matmul_shapes=((1024, 1024, 1024), (32, 1024, 3072)),
    prefill_gemm=(1024, 1024, 1024), decode_gemm=(32, 1024, 3072),
    matmul_seconds=0.3, copy_bytes=GiB // 8,
)


# --------------------------------------------------------------------------- helpers


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token ids, skipping the first three ids (the demo tokenizer's special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(num)]


def prompt_vocab_size(model_dir: Path) -> int:
    """Ids the tokenizer knows (prompts stay inside them); the model's vocab if unknown."""
    tokenizer_file = model_dir / "tokenizer.json"
    if tokenizer_file.is_file():
        data = json.loads(tokenizer_file.read_text())
        vocab = data.get("model", {}).get("vocab")
        if isinstance(vocab, dict) and vocab:
            return len(vocab)
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


class Profiler:
    """cProfile around the timed section when --profile-dir is given; a no-op otherwise."""

    def __init__(self, out_dir: str | None, name: str) -> None:
        self.path = Path(out_dir) / f"{name}.prof" if out_dir else None
        self.profile = cProfile.Profile() if self.path else None

    def __enter__(self) -> Profiler:
        if self.profile:
            self.profile.enable()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.profile and self.path:
            self.profile.disable()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.profile.dump_stats(self.path)


# --------------------------------------------------------------------------- workers


def worker_build(args: argparse.Namespace, wl: Workload) -> dict:
    from openinfer.demo import build_demo_model, get_demo_spec

    build_demo_model(args.model, get_demo_spec(wl.preset))
    return {"built": args.model}


def worker_limits(args: argparse.Namespace, wl: Workload) -> dict:
    import torch

    matmul = {shape_key(s): matmul_flops(*s, wl.matmul_seconds) for s in wl.matmul_shapes}
    return {
        "threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "matmul_flops": matmul,
        "copy_read_bytes_per_s": copy_read_bandwidth(wl.copy_bytes),
        "sum_read_bytes_per_s": sum_read_bandwidth(wl.copy_bytes),
        "gemv_read_bytes_per_s": gemv_read_bandwidth(wl.copy_bytes // 4),
    }


def best_limits(runs: list[dict]) -> dict:
    """Per measure, the best of several limits runs (contention only ever lowers a rate)."""
    best = dict(runs[0])
    best["matmul_flops"] = {k: max(r["matmul_flops"][k] for r in runs) for k in runs[0]["matmul_flops"]}
    for key in ("copy_read_bytes_per_s", "sum_read_bytes_per_s", "gemv_read_bytes_per_s"):
        best[key] = max(r[key] for r in runs)
    return best


def shape_key(shape: tuple[int, int, int]) -> str:
    return "x".join(map(str, shape))


def matmul_flops(m: int, k: int, n: int, seconds: float) -> float:
    """FLOP/s of float32 [m x k] @ [k x n] (the weight stored [n x k], as nn.Linear does)."""
    import torch

    x, w = torch.randn(m, k), torch.randn(n, k)
    out = torch.empty(m, n)
    for _ in range(3):
        torch.mm(x, w.t(), out=out)
    iters, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        torch.mm(x, w.t(), out=out)
        iters += 1
    return 2.0 * m * k * n * iters / elapsed


def copy_read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes READ per second by `dst.copy_(src)` of a float32 tensor of nbytes (best of repeats)."""
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault in dst's pages before timing
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return nbytes / best


def sum_read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes read per second by `src.sum()` of a float32 tensor of nbytes: reads, no writes."""
    import torch

    src = torch.ones(nbytes // 4)
    src.sum()
    best = min(_timed(lambda: src.sum()) for _ in range(repeats))
    return nbytes / best


def gemv_read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Weight bytes read per second by a one-token F.linear over a float32 matrix of nbytes."""
    import torch
    import torch.nn.functional as F

    k = 1024
    w = torch.randn(nbytes // 4 // k, k)
    x = torch.randn(1, k)
    F.linear(x, w)
    best = min(_timed(lambda: F.linear(x, w)) for _ in range(repeats))
    return nbytes / best


def cpu_busy_seconds() -> float:
    """CPU-seconds that all processes of the machine spent busy so far (/proc/stat), 0 if unknown."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return 0.0
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values) - idle) / os.sysconf("SC_CLK_TCK")


def wait_until_quiet(max_wait_s: float, threshold: float = 0.2, window_s: float = 2.0) -> float:
    """Wait (up to max_wait_s) until other processes use under `threshold` cores; returns seconds waited."""
    start = time.perf_counter()
    while True:
        busy = cpu_busy_seconds()
        time.sleep(window_s)
        load = (cpu_busy_seconds() - busy) / window_s
        waited = time.perf_counter() - start
        if load < threshold or waited >= max_wait_s:
            return waited


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _warmup_prompts(model_dir: str, num: int, length: int) -> list[list[int]]:
    """Prompts for the warm-up generate: another seed, so no prefix of them is ever reused."""
    return make_prompts(num, length, prompt_vocab_size(Path(model_dir)), seed=12345)


def _load_openinfer(model_dir: str, warmup_len: int = 16):
    from openinfer.llm import LLM

    llm = LLM(model_dir, seed=0, progress=False)
    llm.generate(_warmup_prompts(model_dir, 2, warmup_len), _openinfer_params(4))
    return llm


def _openinfer_params(max_tokens: int):
    from openinfer.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def worker_openinfer_throughput(args: argparse.Namespace, wl: Workload) -> dict:
    llm = _load_openinfer(args.model)
    prompts = make_prompts(wl.num_prompts, wl.prompt_len, prompt_vocab_size(Path(args.model)), wl.seed)
    with Profiler(args.profile_dir, args.worker):
        start = time.perf_counter()
        outputs = llm.generate(prompts, _openinfer_params(wl.output_len))
        elapsed = time.perf_counter() - start
    tokens = [out.outputs[0].token_ids for out in outputs]
    ttfts = sorted(out.metrics.first_token_time - out.metrics.arrival_time for out in outputs)
    return {"elapsed_s": elapsed, "output_token_ids": tokens, "median_ttft_s": ttfts[len(ttfts) // 2],
            "peak_rss_bytes": peak_rss_bytes()}


def worker_openinfer_latency(args: argparse.Namespace, wl: Workload) -> dict:
    llm = _load_openinfer(args.model, warmup_len=wl.latency_prompt_len)
    prompt = make_prompts(1, wl.latency_prompt_len, prompt_vocab_size(Path(args.model)), wl.seed + 1)
    with Profiler(args.profile_dir, args.worker):
        (output,) = llm.generate(prompt, _openinfer_params(wl.latency_output_len))
    m = output.metrics
    return {"ttft_s": m.first_token_time - m.arrival_time,
            "decode_s": m.finished_time - m.first_token_time,
            "output_token_ids": [output.outputs[0].token_ids],
            "peak_rss_bytes": peak_rss_bytes(), "kv_pool_bytes": _kv_pool_bytes(llm)}


def _kv_pool_bytes(llm) -> int | None:
    """Bytes of the engine's KV block pool(s), read from engine internals (None if they moved)."""
    runner = getattr(getattr(llm.engine, "core", None), "runner", None)
    caches = getattr(runner, "kv_caches", None)
    if not caches:
        return None
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in caches}
    return sum(storages.values())


def _load_hf(model_dir: str, warmup_len: int = 16):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_grad_enabled(False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    _hf_generate(model, _warmup_prompts(model_dir, 2, warmup_len), 4)
    return model


def _hf_generate(model, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy batched generate of exactly new_tokens per prompt; returns (new ids, seconds)."""
    import torch

    ids = torch.tensor(prompts, dtype=torch.long)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         pad_token_id=model.generation_config.pad_token_id)
    elapsed = time.perf_counter() - start
    return out[:, ids.shape[1]:].tolist(), elapsed


def worker_hf_throughput(args: argparse.Namespace, wl: Workload) -> dict:
    model = _load_hf(args.model)
    prompts = make_prompts(wl.num_prompts, wl.prompt_len, prompt_vocab_size(Path(args.model)), wl.seed)
    with Profiler(args.profile_dir, args.worker):
        tokens, elapsed = _hf_generate(model, prompts, wl.output_len)
    return {"elapsed_s": elapsed, "output_token_ids": tokens, "peak_rss_bytes": peak_rss_bytes()}


def worker_hf_latency(args: argparse.Namespace, wl: Workload) -> dict:
    model = _load_hf(args.model, warmup_len=wl.latency_prompt_len)
    prompt = make_prompts(1, wl.latency_prompt_len, prompt_vocab_size(Path(args.model)), wl.seed + 1)
    with Profiler(args.profile_dir, args.worker):
        _, ttft = _hf_generate(model, prompt, 1)
        tokens, total = _hf_generate(model, prompt, wl.latency_output_len)
    return {"ttft_s": ttft, "decode_s": total - ttft, "output_token_ids": tokens,
            "peak_rss_bytes": peak_rss_bytes()}


WORKERS: dict[str, Callable[[argparse.Namespace, Workload], dict]] = {
    "build": worker_build,
    "limits": worker_limits,
    "openinfer-throughput": worker_openinfer_throughput,
    "hf-throughput": worker_hf_throughput,
    "openinfer-latency": worker_openinfer_latency,
    "hf-latency": worker_hf_latency,
}


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


# --------------------------------------------------------------------------- model facts


@dataclass(frozen=True)
class ModelFacts:
    path: str
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tied_embeddings: bool
    total_params: int
    embedding_params: int
    matmul_params: int
    """Weights of every Linear incl. the LM head (the tied embedding counts here if tied)."""
    decode_read_params: int
    """Parameters a decode step reads in full: all but the embedding table."""

    @property
    def weight_bytes(self) -> int:
        return 4 * self.total_params

    @property
    def decode_read_bytes(self) -> int:
        return 4 * self.decode_read_params


def safetensors_shapes(model_dir: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, read from the safetensors headers (no tensor data is loaded)."""
    shapes: dict[str, list[int]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with file.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def model_facts(model_dir: Path) -> ModelFacts:
    hf = json.loads((model_dir / "config.json").read_text())
    shapes = safetensors_shapes(model_dir)
    numel = {name: _prod(shape) for name, shape in shapes.items()}
    embed = sum(n for name, n in numel.items() if name.endswith("embed_tokens.weight"))
    has_head = any(name.endswith("lm_head.weight") for name in numel)
    tied = bool(hf.get("tie_word_embeddings", False)) or not has_head
    head_from_embed = embed if tied and not has_head else 0
    matrices = sum(n for name, n in numel.items()
                   if len(shapes[name]) == 2 and not name.endswith("embed_tokens.weight"))
    total = sum(numel.values())
    return ModelFacts(
        path=str(model_dir), architecture=(hf.get("architectures") or ["?"])[0],
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        vocab_size=hf["vocab_size"], tied_embeddings=tied, total_params=total,
        embedding_params=embed, matmul_params=matrices + head_from_embed,
        decode_read_params=total - embed + head_from_embed,
    )


def _prod(shape: list[int]) -> int:
    result = 1
    for dim in shape:
        result *= dim
    return result


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# --------------------------------------------------------------------------- figures


@dataclass
class Figures:
    """Everything the report prints, derived from the workers' raw results."""

    matmul_gflops: dict[str, float]
    peak_gflops: float
    copy_read_gbs: float
    sum_read_gbs: float
    gemv_read_gbs: float
    compute_limit_tps: float
    shape_ceiling_tps: float
    """Throughput with prefill GEMMs at the prefill shape's rate and decode at the decode shape's."""
    bandwidth_bound_tps: float
    oi_total_tps: float
    oi_output_tps: float
    oi_wall_s: float
    oi_ttft_s: float
    oi_decode_tps: float
    oi_rss_bytes: int
    oi_kv_pool_bytes: int | None
    hf_total_tps: float | None = None
    hf_output_tps: float | None = None
    hf_wall_s: float | None = None
    hf_ttft_s: float | None = None
    hf_decode_tps: float | None = None
    hf_rss_bytes: int | None = None
    identical_throughput: int | None = None
    first_divergence: list[int] | None = None
    identical_latency: bool | None = None


def derive(wl: Workload, facts: ModelFacts, limits: dict, results: dict[str, dict]) -> Figures:
    peak = max(limits["matmul_flops"].values())
    total_tokens = wl.num_prompts * (wl.prompt_len + wl.output_len)
    output_tokens = wl.num_prompts * wl.output_len
    decode_steps = wl.latency_output_len - 1
    oi_t, oi_l = results["openinfer-throughput"], results["openinfer-latency"]
    fig = Figures(
        matmul_gflops={k: v / 1e9 for k, v in limits["matmul_flops"].items()},
        peak_gflops=peak / 1e9,
        copy_read_gbs=limits["copy_read_bytes_per_s"] / 1e9,
        sum_read_gbs=limits["sum_read_bytes_per_s"] / 1e9,
        gemv_read_gbs=limits["gemv_read_bytes_per_s"] / 1e9,
        compute_limit_tps=peak / (2 * facts.matmul_params),
        shape_ceiling_tps=shape_ceiling(wl, facts, limits["matmul_flops"]),
        bandwidth_bound_tps=limits["copy_read_bytes_per_s"] / facts.decode_read_bytes,
        oi_total_tps=total_tokens / oi_t["elapsed_s"],
        oi_output_tps=output_tokens / oi_t["elapsed_s"],
        oi_wall_s=oi_t["elapsed_s"],
        oi_ttft_s=oi_l["ttft_s"],
        oi_decode_tps=decode_steps / oi_l["decode_s"],
        oi_rss_bytes=oi_l["peak_rss_bytes"],
        oi_kv_pool_bytes=oi_l.get("kv_pool_bytes"),
    )
    if "hf-throughput" in results:
        hf_t, hf_l = results["hf-throughput"], results["hf-latency"]
        fig.hf_total_tps = total_tokens / hf_t["elapsed_s"]
        fig.hf_output_tps = output_tokens / hf_t["elapsed_s"]
        fig.hf_wall_s = hf_t["elapsed_s"]
        fig.hf_ttft_s = hf_l["ttft_s"]
        # Timing noise can make the 1-token generate outlast the full one on a tiny model.
        fig.hf_decode_tps = decode_steps / hf_l["decode_s"] if hf_l["decode_s"] > 0 else None
        fig.hf_rss_bytes = hf_l["peak_rss_bytes"]
        pairs = list(zip(oi_t["output_token_ids"], hf_t["output_token_ids"]))
        fig.identical_throughput = sum(a == b for a, b in pairs)
        fig.first_divergence = [_first_difference(a, b) for a, b in pairs if a != b]
        fig.identical_latency = oi_l["output_token_ids"] == hf_l["output_token_ids"]
    return fig


def shape_ceiling(wl: Workload, facts: ModelFacts, matmul_flops: dict[str, float]) -> float:
    """Tokens/s of the throughput workload if it did nothing but its GEMMs, prompt tokens at the
    prefill shape's measured rate and output tokens at the decode shape's (same 2 x P per token)."""
    flops_per_token = 2 * facts.matmul_params
    seconds = (wl.num_prompts * wl.prompt_len * flops_per_token / matmul_flops[shape_key(wl.prefill_gemm)]
               + wl.num_prompts * wl.output_len * flops_per_token / matmul_flops[shape_key(wl.decode_gemm)])
    return wl.num_prompts * (wl.prompt_len + wl.output_len) / seconds


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# --------------------------------------------------------------------------- report


def _num(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def _met(value: float | None, goal: float) -> str:
    if value is None:
        return "n/a"
    return "**yes**" if value >= goal else "**no**"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def limits_section(fig: Figures, facts: ModelFacts, wl: Workload) -> str:
    rows = [[f"float32 matmul {_shape_label(shape)}", f"{_num(gflops)} GFLOP/s"]
            for shape, gflops in fig.matmul_gflops.items()]
    rows += [
        ["**compute limit** (best matmul rate; each measure is the best of a run at the start "
         "and one at the end)", f"**{_num(fig.peak_gflops)} GFLOP/s**"],
        ["memory bandwidth: bytes read per second of `dst.copy_(src)` (read+write = 2x)",
         f"**{_num(fig.copy_read_gbs, 2)} GB/s** ({_num(2 * fig.copy_read_gbs, 2)} GB/s r+w)"],
        ["(context) read-only stream: bytes read per second of `src.sum()`",
         f"{_num(fig.sum_read_gbs, 2)} GB/s"],
        ["(context) one-token `F.linear` over a large weight, weight bytes read per second",
         f"{_num(fig.gemv_read_gbs, 2)} GB/s"],
        [f"=> throughput limit: compute limit / (2 x {facts.matmul_params / 1e6:.1f}M matmul params)",
         f"{_num(fig.compute_limit_tps)} tokens/s"],
        [f"(context) the throughput workload if it ran only GEMMs: prompt tokens at the "
         f"{_shape_label(shape_key(wl.prefill_gemm))} rate, output tokens at the "
         f"{_shape_label(shape_key(wl.decode_gemm))} rate",
         f"{_num(fig.shape_ceiling_tps)} tokens/s ({fig.shape_ceiling_tps / fig.compute_limit_tps:.2f} "
         "of the limit)"],
        [f"=> decode bound: bandwidth / {facts.decode_read_bytes / GiB:.2f} GiB of weights per step",
         f"{_num(fig.bandwidth_bound_tps, 2)} tokens/s"],
    ]
    return _table(["Machine limit", "Measured"], rows)


def _shape_label(shape: str) -> str:
    m, k, n = shape.split("x")
    return f"[{m} x {k}] @ [{k} x {n}]"


def throughput_section(fig: Figures, wl: Workload) -> str:
    oi_frac = fig.oi_total_tps / fig.compute_limit_tps
    hf_frac = None if fig.hf_total_tps is None else fig.hf_total_tps / fig.compute_limit_tps
    rows = [
        ["total tokens/s (input + output)", _num(fig.oi_total_tps), _num(fig.hf_total_tps),
         _ratio(fig.oi_total_tps, fig.hf_total_tps)],
        ["output tokens/s", _num(fig.oi_output_tps), _num(fig.hf_output_tps),
         _ratio(fig.oi_output_tps, fig.hf_output_tps)],
        ["wall time (s)", _num(fig.oi_wall_s, 2), _num(fig.hf_wall_s, 2),
         _ratio(fig.hf_wall_s, fig.oi_wall_s)],
        ["fraction of compute limit", f"{oi_frac:.2f}", _num(hf_frac, 2), ""],
    ]
    title = (f"{wl.num_prompts} prompts x {wl.prompt_len} random input tokens x {wl.output_len} "
             "output tokens, greedy, ignore_eos")
    text = f"**Offline throughput** — {title}\n\n"
    text += _table(["", "openinfer", "HF transformers", "openinfer / HF"], rows)
    if fig.identical_throughput is not None:
        text += (f"\n\nGreedy outputs identical to transformers': {fig.identical_throughput}/"
                 f"{wl.num_prompts} sequences")
        if fig.first_divergence:
            text += f" (the others first differ at output positions {sorted(fig.first_divergence)})"
        text += "."
    return text


def latency_section(fig: Figures, wl: Workload) -> str:
    rows = [
        ["time to first token (s)", _num(fig.oi_ttft_s, 3), _num(fig.hf_ttft_s, 3),
         (_ratio(fig.hf_ttft_s, fig.oi_ttft_s) + " faster") if fig.hf_ttft_s else "n/a"],
        [f"decode tokens/s ({wl.latency_output_len - 1} tokens after the first)",
         _num(fig.oi_decode_tps, 2), _num(fig.hf_decode_tps, 2),
         _ratio(fig.oi_decode_tps, fig.hf_decode_tps)],
        ["fraction of the bandwidth bound", f"{fig.oi_decode_tps / fig.bandwidth_bound_tps:.2f}",
         _num(None if fig.hf_decode_tps is None else fig.hf_decode_tps / fig.bandwidth_bound_tps, 2),
         ""],
    ]
    text = (f"**Single request** — {wl.latency_prompt_len} input / {wl.latency_output_len} output "
            "tokens, greedy\n\n")
    text += _table(["", "openinfer", "HF transformers", "openinfer vs HF"], rows)
    if fig.identical_latency is not None:
        text += f"\n\nGreedy output identical to transformers': {'yes' if fig.identical_latency else 'no'}."
    return text


def memory_section(fig: Figures, facts: ModelFacts) -> str:
    weights = facts.weight_bytes
    rows = [
        ["peak RSS (GiB)", _num(fig.oi_rss_bytes / GiB, 2),
         "n/a" if fig.hf_rss_bytes is None else _num(fig.hf_rss_bytes / GiB, 2)],
        ["peak RSS / float32 weights", f"{fig.oi_rss_bytes / weights:.2f}",
         "n/a" if fig.hf_rss_bytes is None else f"{fig.hf_rss_bytes / weights:.2f}"],
        ["of which KV cache pool, allocated up front (GiB)",
         "n/a" if fig.oi_kv_pool_bytes is None else _num(fig.oi_kv_pool_bytes / GiB, 2),
         "grows with the sequences"],
    ]
    text = (f"**Peak memory** of the process that loads the engine and runs the single request "
            f"(ru_maxrss); float32 weights = {weights / GiB:.2f} GiB\n\n")
    return text + _table(["", "openinfer", "HF transformers"], rows)


def goals_section(fig: Figures) -> str:
    vs_hf = None if fig.hf_total_tps is None else fig.oi_total_tps / fig.hf_total_tps
    compute = fig.oi_total_tps / fig.compute_limit_tps
    bandwidth = fig.oi_decode_tps / fig.bandwidth_bound_tps
    rows = [
        ["offline total tokens/s, openinfer / HF", f">= {GOAL_THROUGHPUT_VS_HF}", _num(vs_hf, 2),
         _met(vs_hf, GOAL_THROUGHPUT_VS_HF)],
        ["offline total tokens/s / compute limit", f">= {GOAL_COMPUTE_FRACTION}", f"{compute:.2f}",
         _met(compute, GOAL_COMPUTE_FRACTION)],
        ["decode tokens/s / bandwidth bound", f">= {GOAL_BANDWIDTH_FRACTION}", f"{bandwidth:.2f}",
         _met(bandwidth, GOAL_BANDWIDTH_FRACTION)],
    ]
    return "**Goals**\n\n" + _table(["Goal", "Target", "Measured", "Met"], rows)


@dataclass(frozen=True)
class RunInfo:
    date: str
    nproc: int
    cpu: str
    torch_version: str
    threads: int
    load_before: float
    load_after: float
    duration_s: float
    quick: bool
    command: str


def header_section(info: RunInfo, facts: ModelFacts) -> str:
    kind = " (QUICK run: tiny model, not representative)" if info.quick else ""
    model = (f"`{Path(facts.path).name}`: {facts.architecture}, {facts.total_params / 1e6:.1f}M "
             f"parameters ({facts.matmul_params / 1e6:.1f}M in matmuls per token, "
             f"{facts.embedding_params / 1e6:.1f}M embedding), {facts.num_layers} layers, hidden "
             f"{facts.hidden_size}, MLP {facts.intermediate_size}, {facts.num_heads} heads / "
             f"{facts.num_kv_heads} KV heads, vocab {facts.vocab_size}, "
             f"{'tied' if facts.tied_embeddings else 'untied'} embeddings; run in float32")
    return "\n".join([
        f"## Offline benchmark{kind}",
        "",
        f"- Date: {info.date}; the whole run (`{info.command}`) took {info.duration_s / 60:.1f} min.",
        f"- Machine: {info.nproc} CPUs ({info.cpu}), torch {info.torch_version}, "
        f"{info.threads} torch threads; no GPU.",
        f"- Model: {model}.",
        f"- Load average (1 min) before / after: {info.load_before:.2f} / {info.load_after:.2f}. "
        "Other processes may share these CPUs, so the figures are noisy (a few to tens of "
        "percent; see the noise table below); ratios of engines measured in the same run are the "
        "more reliable figures.",
    ])


def noise_section(results: dict[str, dict], nproc: int) -> str:
    rows = [[name, _num(r["phase"]["wall_s"]), f"{r['phase']['other_cores']:.2f} of {nproc}"]
            for name, r in results.items()]
    return ("**Noise**: CPU used by other processes while each phase ran (busy time in /proc/stat "
            "minus this benchmark's own); above ~0.2 cores the figures of that phase are "
            "unreliable.\n\n"
            + _table(["Phase (own process)", "Wall time (s)", "Other processes' CPU (cores)"], rows))


def conventions_section(facts: ModelFacts, fig: Figures) -> str:
    return "\n".join([
        "Conventions:",
        f"- Compute limit in tokens/s = best measured float32 matmul FLOP/s / (2 x "
        f"{facts.matmul_params:,} parameters): every Linear weight including the LM head, excluding "
        "the embedding table (a lookup). Attention score FLOPs and the LM head being skipped for "
        "non-final prompt positions are not counted (a few percent here).",
        "- Bandwidth = bytes READ per second of a large `dst.copy_(src)` (the copy moves twice "
        "that); a decode step streams each weight once, so reads are what bound it. Decode bound "
        f"= bandwidth / {facts.decode_read_bytes:,} bytes (float32 bytes of every parameter but the "
        "embedding table, of which a step reads only one row per sequence). The copy's read rate "
        f"({fig.copy_read_gbs:.1f} GB/s) is close to what a one-token `F.linear` reads "
        f"({fig.gemv_read_gbs:.1f} GB/s), the kernel a decode step runs; a pure read stream "
        f"(`src.sum()`) reaches {fig.sum_read_gbs:.1f} GB/s, against which the decode fractions "
        f"would be {fig.copy_read_gbs / fig.sum_read_gbs:.2f}x as large.",
        "- TTFT of openinfer = first_token_time - arrival_time of the request; decode tokens/s = "
        "(output tokens - 1) / (finished_time - first_token_time). For transformers, TTFT is the "
        "wall time of a max_new_tokens=1 generate, and decode time is the full generate minus it.",
        "- Each measurement runs in its own process after a short warm-up generate; prompts are "
        "random token ids (seed 0).",
    ])


def render(info: RunInfo, facts: ModelFacts, fig: Figures, wl: Workload,
           results: dict[str, dict]) -> str:
    parts = [
        header_section(info, facts),
        limits_section(fig, facts, wl),
        throughput_section(fig, wl),
        latency_section(fig, wl),
        memory_section(fig, facts),
        goals_section(fig),
        noise_section(results, info.nproc),
        conventions_section(facts, fig),
        "How to reproduce: `make bench` (runs `.venv/bin/python benchmarks/bench_offline.py`; "
        "`--quick` for a one-minute smoke run, `--skip-hf` to skip the transformers baseline).",
    ]
    return "\n\n".join(parts)


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
