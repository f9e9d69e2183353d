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


def test_generate_sampling_flags_reach_the_request(qwen3_checkpoint, capsys):
    """`generate`'s sampling flags give what the offline API gives for the same parameters
    (each flag changes the text, so a dropped flag shows)."""
    from openinfer import LLM, SamplingParams
    from openinfer.cli import main

    flags = ["--temperature", "1.3", "--top-p", "0.9", "--top-k", "40", "--n", "2",
             "--sample-seed", "7", "--max-tokens", "12", "--ignore-eos"]
    code = main(["generate", "--model", str(qwen3_checkpoint), "--prompt", "Hello there",
                 "--kv-cache-memory", "16MiB", *flags])
    assert code == 0
    printed = capsys.readouterr().out
    llm = LLM(str(qwen3_checkpoint), kv_cache_memory=16 * 2**20, progress=False)
    outputs = llm.generate(["Hello there"], SamplingParams(
        temperature=1.3, top_p=0.9, top_k=40, n=2, seed=7, max_tokens=12, ignore_eos=True))
    texts = [c.text for c in outputs[0].outputs]
    assert len(set(texts)) == 2  # two samples, seeded per sample
    for i, text in enumerate(texts):
        assert f"--- output {i} (12 tokens, finish_reason=length)\n{text}\n" in printed
    greedy = llm.generate(["Hello there"], SamplingParams(max_tokens=12, ignore_eos=True))
    assert greedy[0].outputs[0].text not in texts  # the flags changed the text
    # --stop: cut at the first occurrence of a string the sampled text holds.
    stop = next(texts[0][i:i + 3] for i in range(1, len(texts[0]) - 2) if texts[0][i:i + 3].strip())
    code = main(["generate", "--model", str(qwen3_checkpoint), "--prompt", "Hello there",
                 "--kv-cache-memory", "16MiB", *flags, "--stop", stop])
    printed = capsys.readouterr().out
    assert code == 0 and "finish_reason=stop)\n" + texts[0][:texts[0].index(stop)] + "\n" in printed
