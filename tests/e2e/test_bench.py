"""`openinfer bench` against a live server process: every workload, exact counts, failures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from server_process import MODEL, start_server

from openinfer.cli import main


@pytest.fixture(scope="module")
def server(qwen3_checkpoint):
    base, proc = start_server(qwen3_checkpoint, "--kv-cache-memory", "16MiB")
    yield base
    proc.kill()
    proc.wait()


def _bench(server: str, checkpoint, out, *flags: str) -> tuple[int, dict | None]:
    code = main(["bench", "serve", "--base-url", server, "--model", MODEL, "--tokenizer",
                 str(checkpoint), "--no-progress", "--output", str(out), *flags])
    return code, json.loads(out.read_text()) if out.exists() else None


def _requests(result: dict) -> list[dict]:
    return [r for run in result["runs"] for r in run["requests"]]


@pytest.mark.slow
def test_every_workload_runs_with_exact_token_counts(server, qwen3_checkpoint, tmp_path):
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "Hello, who are you?"},
                           {"from": "gpt", "value": "A tiny test model."}]},
        {"conversations": [{"from": "human", "value": "Only one turn"}]},
    ]))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in [
        {"timestamp": 0, "input_length": 40, "output_length": 3, "hash_ids": [7, 8]},
        {"timestamp": 300, "input_length": 50, "output_length": 2, "hash_ids": [7, 8, 9]},
    ]))
    cases = {
        "random": (["--num-requests", "6", "--input-len", "24", "--output-len", "5",
                    "--range-ratio", "0.5", "--request-rate", "20,inf"], 12),
        "shared-prefix": (["--num-groups", "2", "--prompts-per-group", "3", "--prefix-len", "32",
                           "--input-len", "8", "--output-len", "4", "--concurrency", "2"], 6),
        "multi-turn": (["--num-users", "2", "--num-turns", "3", "--prefix-len", "16",
                        "--input-len", "8", "--output-len", "4", "--think-time", "0.05"], 6),
        "sharegpt": (["--dataset", str(sharegpt), "--num-requests", "3"], 3),
        "replay": (["--dataset", str(trace), "--replay-block-size", "16"], 2),
    }
    results = {}
    for workload, (flags, count) in cases.items():
        code, result = _bench(server, qwen3_checkpoint, tmp_path / f"{workload}.json",
                              "--workload", workload, *flags)
        assert code == 0, workload
        requests = _requests(result)
        assert len(requests) == count and all(r["ok"] for r in requests), workload
        for run in result["runs"]:
            s = run["summary"]
            assert s["failed"] == 0 and s["output_tokens_exact"] and s["prompt_tokens_agree"]
            assert s["output_tokens"] == sum(r["expected_output_tokens"] for r in run["requests"])
            assert 0 <= s["cache_hit_rate"] <= 1 and s["ttft_ms"]["p50"] > 0
            assert run["economics"]["revenue_per_hour"] > 0
        results[workload] = result
    random_lengths = {r["prompt_tokens"] for r in _requests(results["random"])}
    assert len(random_lengths) > 1 and all(12 <= n <= 36 for n in random_lengths)

    # shared-prefix: every prompt after the first of its group could reuse its 32-token prefix.
    shared = results["shared-prefix"]["runs"][0]["summary"]
    assert shared["oracle_hit_rate"] == pytest.approx(4 * 32 / (6 * 40))
    # multi-turn: a later turn resends the whole earlier turn, so the oracle holds it all.
    by_user: dict[int, list[dict]] = {}
    for r in _requests(results["multi-turn"]):
        by_user.setdefault(r["session"], []).append(r)
    for turns in by_user.values():
        turns.sort(key=lambda r: r["turn"])
        for before, after in zip(turns, turns[1:]):
            assert after["oracle_hit_tokens"] >= before["prompt_tokens"] + before["output_tokens"] - 1
            assert after["prompt_tokens"] > before["prompt_tokens"] + before["output_tokens"]
    # replay: the second record shares two 16-token blocks with the first.
    replay = _requests(results["replay"])
    assert [r["oracle_hit_tokens"] for r in replay] == [0, 32]
    assert replay[1]["start_s"] >= 0.3

    out = subprocess.run([sys.executable, "-m", "openinfer.cli", "bench", "compare",
                          str(tmp_path / "random.json"), str(tmp_path / "shared-prefix.json"),
                          "--plot", str(tmp_path / "sweep.png")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "random@20.0" in out.stdout and "random@inf" in out.stdout
    assert (tmp_path / "sweep.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_failures_are_reported_saved_and_exit_nonzero(server, qwen3_checkpoint, tmp_path):
    # A server that answers every request with an error (an unknown model: 404).
    out = tmp_path / "wrong-model.json"
    code = main(["bench", "serve", "--base-url", server, "--model", "nope", "--tokenizer",
                 str(qwen3_checkpoint), "--num-requests", "3", "--input-len", "8",
                 "--output-len", "2", "--no-progress", "--output", str(out)])
    result = json.loads(out.read_text())
    assert code == 1 and result["runs"][0]["summary"]["failed"] == 3
    assert "HTTP 404" in result["runs"][0]["summary"]["errors"][0]

    # Nothing listens at this URL.
    code, result = _bench("http://127.0.0.1:9", qwen3_checkpoint, tmp_path / "no-server.json",
                          "--num-requests", "2", "--input-len", "8", "--output-len", "2")
    assert code == 1 and result["runs"][0]["summary"]["failed"] == 2
    assert "Connect" in result["runs"][0]["summary"]["errors"][0]

    # A trace that does not parse: a clear message and exit status 2 from the real CLI.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 4}\n')
    proc = subprocess.run([sys.executable, "-m", "openinfer.cli", "bench", "serve", "--base-url",
                           server, "--model", MODEL, "--tokenizer", str(qwen3_checkpoint),
                           "--workload", "replay", "--dataset", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "bad.jsonl:1: not a trace record" in proc.stderr
