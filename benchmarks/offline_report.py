"""The report of bench_offline.py: figures derived from the workers' raw results, and their
Markdown rendering (the section written between the bench_offline markers)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from offline_limits import shape_key
from offline_workload import GiB, ModelFacts, Workload

GOAL_THROUGHPUT_VS_HF = 1.5
GOAL_COMPUTE_FRACTION = 0.7
GOAL_BANDWIDTH_FRACTION = 0.6


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
