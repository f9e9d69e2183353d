"""Start `openinfer serve` (or `router`) as a real process on a free loopback port, for tests."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

MODEL = "tiny"
"""The name test servers serve their checkpoint under."""
ADMIN_KEY = "test-admin-key"
"""Every server and router a test starts takes this admin key (OPENINFER_ADMIN_API_KEY)."""
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def start_server(checkpoint, *flags: str, port: int | None = None,
                 admin_key: str | None = ADMIN_KEY,
                 host: str | None = None) -> tuple[str, subprocess.Popen]:
    """``host``: passed as ``--host`` and used in the returned base URL (default: the
    server's own default, 127.0.0.1)."""
    return _start(_serve_args(checkpoint, flags), port, admin_key, host)


def start_servers(*servers: tuple, admin_key: str | None = ADMIN_KEY,
                  ) -> list[tuple[str, subprocess.Popen]]:
    """Several `openinfer serve` processes started at once (each a (checkpoint, *flags)
    tuple), returned in that order once every one answers /health: their start-ups (mostly
    imports) overlap on the machine's cores instead of running one after another."""
    return _start_all([_serve_args(checkpoint, flags) for checkpoint, *flags in servers],
                      admin_key)


def _serve_args(checkpoint, flags) -> list[str]:
    # The KV pool: OPENINFER_CPU_KV_CACHE_MEMORY from tests/conftest.py, unless flags set one.
    return ["serve", "--model", str(checkpoint), "--served-model-name", MODEL, *flags]


def start_router(workers: list[str], checkpoint, *flags: str,
                 admin_key: str | None = ADMIN_KEY) -> tuple[str, subprocess.Popen]:
    return _start(_router_args(workers, checkpoint, flags), None, admin_key)


def start_routers(workers: list[str], checkpoint, *flag_sets: tuple[str, ...],
                  admin_key: str | None = ADMIN_KEY) -> list[tuple[str, subprocess.Popen]]:
    """One router over ``workers`` per set of flags, started at once (as start_servers)."""
    return _start_all([_router_args(workers, checkpoint, flags) for flags in flag_sets],
                      admin_key)


def _router_args(workers: list[str], checkpoint, flags) -> list[str]:
    worker_flags = [arg for url in workers for arg in ("--worker", url)]
    return ["router", *worker_flags, "--tokenizer", str(checkpoint), *flags]


def _start_all(arg_lists: list[list[str]],
               admin_key: str | None) -> list[tuple[str, subprocess.Popen]]:
    launched = [_launch(args, None, admin_key) for args in arg_lists]
    try:
        return [_wait_healthy(proc, args) for args, proc in zip(arg_lists, launched)]
    except BaseException:
        for proc in launched:
            if proc.poll() is None:
                proc.kill()
        raise


def _start(args: list[str], port: int | None, admin_key: str | None = ADMIN_KEY,
           host: str | None = None) -> tuple[str, subprocess.Popen]:
    return _wait_healthy(_launch(args, port, admin_key, host), args)


_LOGS = tempfile.TemporaryDirectory(prefix="openinfer-test-logs-")
"""Where every process started here writes its stdout and stderr: a file, never a pipe
that nobody drains (a server that logs 64 KiB would block on it)."""


def _launch(args: list[str], port: int | None, admin_key: str | None = ADMIN_KEY,
            host: str | None = None) -> subprocess.Popen:
    """``port`` None: --port 0, the kernel picks a free one and the process says which
    (picking one here and handing it over would race with every other process)."""
    if host is not None:
        args = [*args, "--host", host]
    env = {k: v for k, v in os.environ.items() if k != "OPENINFER_ADMIN_API_KEY"}
    # One compute thread per process: the suite runs several servers (and its own engines)
    # at once on a 2-core box, where two threads each oversubscribe the cores and OpenMP's
    # barriers spin (two tiny-model servers answering at once took 1.7x as long as one after
    # the other). Multi-threaded kernels are tested in the suite's own process.
    env.setdefault("OMP_NUM_THREADS", "1")
    if admin_key is not None:
        env["OPENINFER_ADMIN_API_KEY"] = admin_key
    with tempfile.NamedTemporaryFile("wb", dir=_LOGS.name, suffix=".log", delete=False) as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "openinfer.cli", *args, "--port", str(port or 0),
             "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT, env=env)
    _LOG_OF[proc.pid] = Path(log.name)
    return proc


_LOG_OF: dict[int, Path] = {}


def output(proc: subprocess.Popen) -> str:
    """What a process started here has written so far (stdout and stderr)."""
    return _LOG_OF[proc.pid].read_text(errors="replace")


_LISTENING = re.compile(r"^openinfer: listening on (http://\S+)$", re.MULTILINE)


def _wait_healthy(proc: subprocess.Popen, args: list[str]) -> tuple[str, subprocess.Popen]:
    """(base URL, proc) once the process answers /health."""
    deadline = time.monotonic() + 300  # generous: a loaded 2-core CI box starts Ray slowly
    base = None
    while True:
        try:
            if base is None and (bound := _LISTENING.search(output(proc))):
                base = bound.group(1)
            if base is not None:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                return base, proc
        except (urllib.error.URLError, ConnectionError, TimeoutError):  # bound, still loading
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{args[0]} did not start:\n{output(proc)}")
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (a graceful drain), then SIGKILL if it takes more than 30 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def admin_workers(router: str) -> list[dict]:
    """The router's replicas, as its admin API lists them."""
    resp = urllib.request.urlopen(urllib.request.Request(f"{router}/admin/workers", headers=ADMIN),
                                  timeout=30)
    return json.loads(resp.read())["workers"]


def process_running(pid: int) -> bool:
    """Alive and not a zombie (an exited child waits to be reaped by whoever adopted it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def metrics(base: str) -> dict[str, float]:
    """A server's samples by name + [label value]... (leaving out model_name and engine)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f"[{v}]" for k, v in sample.labels.items()
                                        if k not in ("model_name", "engine"))
            values[key] = sample.value
    return values
