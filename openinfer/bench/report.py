"""Tables and plots of benchmark results (one run, or several side by side)."""

from __future__ import annotations

import json
from pathlib import Path

from openinfer.bench.metrics import DEFINITIONS

_ROWS: list[tuple[str, str, str]] = [
    # (label, path in a run, format)
    ("request rate (req/s)", "request_rate", "{}"),
    ("concurrency", "concurrency", "{}"),
    ("completed / failed", "summary.completed|summary.failed", "{} / {}"),
    ("duration (s)", "summary.duration_s", "{:.1f}"),
    ("request throughput (req/s)", "summary.request_throughput", "{:.2f}"),
    ("output tokens/s", "summary.output_token_throughput", "{:.1f}"),
    ("total tokens/s", "summary.total_token_throughput", "{:.1f}"),
    ("goodput (req/s)", "summary.goodput", "{:.2f}"),
    ("input-cache hit rate", "summary.cache_hit_rate", "{:.1%}"),
    ("oracle hit rate", "summary.oracle_hit_rate", "{:.1%}"),
    ("prompt tokens L1 / L2 / L3 / pulled / computed",
     "summary.prompt_tokens_by_source.L1|summary.prompt_tokens_by_source.L2|"
     "summary.prompt_tokens_by_source.L3|summary.prompt_tokens_by_source.pulled|"
     "summary.prompt_tokens_by_source.computed", "{} / {} / {} / {} / {}"),
    ("TTFT mean / p50 / p99 (ms)", "summary.ttft_ms.mean|summary.ttft_ms.p50|summary.ttft_ms.p99",
     "{:.0f} / {:.0f} / {:.0f}"),
    ("TTFT p50 first turn / returning turns (ms)",
     "summary.ttft_first_turn_ms.p50|summary.ttft_returning_ms.p50", "{:.0f} / {:.0f}"),
    ("TPOT mean / p50 / p99 (ms)", "summary.tpot_ms.mean|summary.tpot_ms.p50|summary.tpot_ms.p99",
     "{:.1f} / {:.1f} / {:.1f}"),
    ("ITL mean / p50 / p99 (ms)", "summary.itl_ms.mean|summary.itl_ms.p50|summary.itl_ms.p99",
     "{:.1f} / {:.1f} / {:.1f}"),
    ("E2E mean / p50 / p99 (ms)", "summary.e2e_ms.mean|summary.e2e_ms.p50|summary.e2e_ms.p99",
     "{:.0f} / {:.0f} / {:.0f}"),
    ("revenue per accelerator-hour ($)", "economics.revenue_per_accelerator_hour", "{:.4f}"),
    ("cost per accelerator-hour ($)", "economics.accelerator_hour_cost", "{:.2f}"),
    ("margin", "economics.margin", "{:.1%}"),
    ("cost per M output tokens ($)", "economics.cost_per_million_output_tokens", "{:.2f}"),
]


def _get(run: dict, path: str):
    value = run
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def _cell(run: dict, paths: str, fmt: str) -> str:
    values = [_get(run, p) for p in paths.split("|")]
    if any(v is None for v in values):
        return "-"
    return fmt.format(*values)


def table(columns: list[tuple[str, dict]], markdown: bool = False) -> str:
    """Rows are figures, columns are runs: [(column title, run dict)]."""
    header = ["metric", *[title for title, _ in columns]]
    rows = [[label, *[_cell(run, paths, fmt) for _, run in columns]]
            for label, paths, fmt in _ROWS]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt_row = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                  for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt_row(header), *map(fmt_row, rows), DEFINITIONS])


def load_result(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"cannot read benchmark result {path}: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise SystemExit(f"{path} is not an `openinfer bench serve` result (no 'runs' list)")
    return data


def columns_of(paths: list[str]) -> list[tuple[str, dict]]:
    columns = []
    for path in paths:
        runs = load_result(path)["runs"]
        for run in runs:
            title = Path(path).stem if len(runs) == 1 else f"{Path(path).stem}@{run['request_rate']}"
            columns.append((title, run))
    return columns


def plot(paths: list[str], out: str) -> None:
    """Latency against output throughput along each file's request-rate sweep."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from e
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for path in paths:
        runs = [r for r in load_result(path)["runs"] if r["summary"]["completed"]]
        x = [r["summary"]["output_token_throughput"] for r in runs]
        for ax, (name, key) in zip(axes, [("TTFT p50", "ttft_ms.p50"), ("TTFT p99", "ttft_ms.p99"),
                                          ("TPOT mean", "tpot_ms.mean")]):
            y = [_get(r["summary"], key) for r in runs]
            ax.plot(x, y, marker="o", label=Path(path).stem)
            ax.set_xlabel("output tokens/s")
            ax.set_ylabel(f"{name} (ms)")
            ax.set_title(f"{name} vs throughput")
            ax.grid(alpha=0.3)
            for r, xi, yi in zip(runs, x, y):
                if yi is not None:
                    ax.annotate(f"{r['request_rate']}", (xi, yi), fontsize=7)
    axes[0].legend()
    fig.suptitle("request-rate sweep (point labels: requests/s)")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
