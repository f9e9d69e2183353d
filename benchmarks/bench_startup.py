"""`openinfer serve` start-up: seconds from the command to the first 200 on /health.

Two orders of the same code, alternating round by round so the machine's drift hits both:

    overlapped   `openinfer serve` as shipped: the engine core's interpreter is started
                 (openinfer/engine/core_launch.py) before the server imports torch,
                 transformers and FastAPI, so both interpreters import side by side
    sequential   the same command with the server's modules imported first (a wrapper
                 imports them, then calls the CLI): the core's interpreter starts after
                 them, the order before core_launch existed

on the demo model (random weights, 2 layers of 64: the start-up is imports, not loading).

    .venv/bin/python benchmarks/bench_startup.py [--rounds 6] [--model DIR] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SEQUENTIAL = ("import openinfer.engine.async_llm, openinfer.server.app, sys; "
              "from openinfer.cli import main; sys.exit(main(sys.argv[1:]))")
"""The CLI with the server's modules imported before it starts the core."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_to_health(model: str, sequential: bool) -> float:
    port = free_port()
    head = ["-c", SEQUENTIAL] if sequential else ["-m", "openinfer.cli"]
    args = [sys.executable, *head, "serve", "--model", model, "--port", str(port),
            "--kv-cache-memory", "64MiB", "--log-level", "warning"]
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - start < 120:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        return time.perf_counter() - start
            except OSError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}): {' '.join(args)}")
            time.sleep(0.02)
        raise RuntimeError("the server did not answer /health in 120 s")
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--model", help="a checkpoint directory (default: the demo model, built)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from openinfer.demo import build_demo_model

            model = str(build_demo_model(Path(tmp) / "demo"))
        time_to_health(model, sequential=False)  # warm the page cache and .pyc files
        times: dict[str, list[float]] = {"overlapped": [], "sequential": []}
        for r in range(args.rounds):
            order = ("overlapped", "sequential") if r % 2 == 0 else ("sequential", "overlapped")
            for name in order:
                times[name].append(time_to_health(model, sequential=name == "sequential"))
                print(f"round {r}: {name} {times[name][-1]:.2f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = "\n".join(f"| {k} | {med[k]:.2f} | {min(v):.2f}-{max(v):.2f} |" for k, v in times.items())
    body = f"""## Server start-up (benchmarks/bench_startup.py)

Seconds from `openinfer serve` to the first 200 on `/health`, demo model (2 layers of 64:
start-up is imports, not loading), {args.rounds} alternating rounds of each order. Overlapped:
the engine core's interpreter starts before the server imports torch, transformers and
FastAPI (`engine/core_launch.py`); sequential: the same code with those imports done first.

| order | median (s) | range (s) |
|---|---|---|
{rows}

Overlapped over sequential: **{med['sequential'] / med['overlapped']:.2f}x** faster to ready."""
    print(body)
    if not args.no_write:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from doc_sections import write_section

        write_section(REPO / "docs" / "benchmarks.md", "bench_startup", body)


if __name__ == "__main__":
    os.environ.setdefault("OPENINFER_CONFIGURE_LOGGING", "0")
    main()
