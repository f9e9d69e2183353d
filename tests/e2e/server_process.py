"""Start `openinfer serve` as a real process on a free loopback port, for tests."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

MODEL = "tiny"
"""The name test servers serve their checkpoint under."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(checkpoint, *flags: str, port: int | None = None) -> tuple[str, subprocess.Popen]:
    return _start(["serve", "--model", str(checkpoint), "--served-model-name", MODEL, *flags],
                  port)


def start_router(workers: list[str], checkpoint, *flags: str) -> tuple[str, subprocess.Popen]:
    worker_flags = [arg for url in workers for arg in ("--worker", url)]
    return _start(["router", *worker_flags, "--tokenizer", str(checkpoint), *flags], None)


def _start(args: list[str], port: int | None) -> tuple[str, subprocess.Popen]:
    port = port or _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "openinfer.cli", *args, "--port", str(port), "--log-level",
         "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            urllib.request.urlopen(f"{base}/health", timeout=2)
            return base, proc
        except (urllib.error.URLError, ConnectionError):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"{args[0]} did not start:\n{proc.stdout.read()}")
            time.sleep(0.3)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (a graceful drain), then SIGKILL if it takes more than 30 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
