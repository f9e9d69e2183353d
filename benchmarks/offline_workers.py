"""The measurements of bench_offline.py, each run in its own process (`--worker NAME`): building
the demo model, the machine limits, and openinfer's and transformers' throughput and latency.
Each worker returns a JSON-serialisable dict; heavy imports (torch, openinfer, transformers)
happen inside the workers."""

from __future__ import annotations

import argparse
import cProfile
import resource
import time
from collections.abc import Callable
from pathlib import Path

from offline_limits import (
    copy_read_bandwidth,
    gemv_read_bandwidth,
    matmul_flops,
    shape_key,
    sum_read_bandwidth,
)
from offline_workload import Workload, make_prompts, prompt_vocab_size


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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


def _warmup_prompts(model_dir: str, num: int, length: int) -> list[list[int]]:
    """Prompts for the warm-up generate: another seed, so no prefix of them is ever reused."""
    return make_prompts(num, length, prompt_vocab_size(Path(model_dir)), seed=12345)


def _load_openinfer(model_dir: str, warmup_len: int = 16):
    from openinfer.llm import LLM

    # float32, as transformers runs beside it and as the limits are measured: dtype auto
    # would take bf16 on CPUs with AVX512_BF16 or AMX (the peers benchmark compares bf16).
    llm = LLM(model_dir, dtype="float32", seed=0, progress=False)
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
