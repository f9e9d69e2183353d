"""The `openinfer` command line, run as a real process."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "openinfer.cli", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_demo_model_then_generate(tmp_path):
    out_dir = tmp_path / "demo"
    built = _run("demo-model", str(out_dir))
    assert built.returncode == 0, built.stderr
    assert "RANDOM" in built.stdout and (out_dir / "config.json").is_file()

    gen = _run("generate", "--model", str(out_dir), "--prompt", "Hello there", "--prompt", "Bye",
               "--max-tokens", "6", "--ignore-eos", "--kv-cache-memory", "64MiB")
    assert gen.returncode == 0, gen.stderr
    assert "RANDOM" in gen.stderr
    assert gen.stdout.count("--- output 0 (6 tokens, finish_reason=length)") == 2

    bad = _run("generate", "--model", str(out_dir), "--prompt", "", "--max-tokens", "3")
    assert bad.returncode == 2 and "prompt must not be empty" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_missing_model_is_a_clear_error(tmp_path):
    res = _run("generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert res.returncode == 2 and "is not a directory, .gguf file" in res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    res = _run("generate", "--model", str(empty), "--prompt", "x")
    assert res.returncode == 2 and "no config.json" in res.stderr
