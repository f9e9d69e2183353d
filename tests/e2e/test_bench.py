"""`openinfer bench` against a live server process: every workload, exact counts, failures,
the model and tokenizer taken from the server, vLLM's result format."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from server_process import MODEL, metrics, start_server

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
        "agentic": (["--num-users", "2", "--num-turns", "3", "--prefix-len", "16",
                     "--input-len", "8", "--output-len", "4", "--tool-time", "0.1",
                     "--abandon-rate", "0"], 6),
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
            assert run["economics"]["margin"] is None  # no --accelerator-hour-cost given
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
    # agentic: tool results come back after the tool's pause; first and returning turns timed
    # apart.
    agentic = results["agentic"]["runs"][0]
    assert agentic["summary"]["ttft_first_turn_ms"]["p50"] > 0
    assert agentic["summary"]["ttft_returning_ms"]["p50"] > 0
    for r in agentic["requests"]:
        assert r["turn"] == 0 or r["oracle_hit_tokens"] > 16
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


def test_the_reported_hit_rate_is_the_servers_own_count(server, qwen3_checkpoint, tmp_path):
    """The bench's cached tokens (from each response's usage) are the server's prefix-cache
    hit counter over the run; fixed arrivals, SLOs and prices reach the result."""
    hits = "openinfer:prefix_cache_hits_total"
    before = metrics(server).get(hits, 0)
    code, result = _bench(server, qwen3_checkpoint, tmp_path / "hits.json",
                          "--workload", "shared-prefix", "--num-groups", "2",
                          "--prompts-per-group", "4", "--prefix-len", "48", "--input-len", "8",
                          "--output-len", "3", "--request-rate", "20", "--arrival", "fixed",
                          "--slo", "ttft=600000,e2e=1", "--accelerator-hour-cost", "3",
                          "--num-accelerators", "2",
                          "--price", "input_cache_hit=1,input_cache_miss=2,output=4")
    assert code == 0
    run = result["runs"][0]
    s = run["summary"]
    assert s["completed"] == 8 and s["cached_tokens"] > 0
    assert s["cached_tokens"] == metrics(server)[hits] - before
    assert s["cache_hit_rate"] == s["cached_tokens"] / s["prompt_tokens"]
    # By source: this server has the device tier only; the rest was computed.
    by_source = s["prompt_tokens_by_source"]
    assert by_source["L1"] == s["cached_tokens"] and by_source["L2"] == by_source["L3"] == 0
    assert by_source["computed"] == s["prompt_tokens"] - s["cached_tokens"]
    # --arrival fixed: request i is sent at i/20 s, never before (a loaded machine may send
    # it late, so the gaps themselves are not compared).
    starts = sorted(r["start_s"] for r in run["requests"])
    assert all(start >= i / 20 - 0.005 for i, start in enumerate(starts))
    assert starts[-1] - starts[0] >= 0.3
    # --slo: no request finishes within 1 ms end to end, so none is good.
    assert s["slo_ms"] == {"ttft": 600000.0, "e2e": 1.0} and s["goodput"] == 0
    economics = run["economics"]
    assert economics["prices_per_million"] == {"input_cache_hit": 1.0, "input_cache_miss": 2.0,
                                               "output": 4.0}
    assert economics["cost_per_hour"] == 6.0
    seconds = s["duration_s"]
    assert economics["revenue_per_hour"] == pytest.approx(3600 * (
        s["cached_tokens"] * 1 + (s["prompt_tokens"] - s["cached_tokens"]) * 2
        + s["output_tokens"] * 4) / seconds / 1e6)


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


def _bench_from_server(server: str, out, *flags: str) -> tuple[int, dict | None]:
    """`bench serve` as a vLLM user runs it: no --model, no --tokenizer."""
    code = main(["bench", "serve", "--base-url", server, "--no-progress", "--output", str(out),
                 *flags])
    return code, json.loads(out.read_text()) if out.exists() else None


def _in_order(result: dict) -> list[dict]:
    return sorted(_requests(result), key=lambda r: (r["session"], r["turn"]))


@pytest.mark.slow
def test_model_and_tokenizer_from_the_server_give_the_same_counts(server, qwen3_checkpoint,
                                                                   tmp_path):
    cases = {"random": ["--num-requests", "5", "--input-len", "20", "--output-len", "3",
                        "--range-ratio", "0.5"],
             "multi-turn": ["--num-users", "2", "--num-turns", "2", "--prefix-len", "16",
                            "--input-len", "8", "--output-len", "3"]}
    for workload, flags in cases.items():
        code, given = _bench(server, qwen3_checkpoint, tmp_path / f"{workload}-given.json",
                             "--workload", workload, *flags)
        assert code == 0, workload
        code, served = _bench_from_server(server, tmp_path / f"{workload}-served.json",
                                          "--workload", workload, *flags)
        assert code == 0, workload
        assert served["model"] == MODEL and served["tokenizer"] == f"{server}/tokenize"
        for result in (given, served):
            s = result["runs"][0]["summary"]
            assert s["failed"] == 0 and s["prompt_tokens_agree"] and s["output_tokens_exact"]
        pairs = list(zip(_in_order(given), _in_order(served), strict=True))
        assert len(pairs) == (5 if workload == "random" else 4)
        # A first turn is the same prompt either way (later turns carry the model's answers).
        counts = lambda r: (r["session"], r["prompt_tokens"], r["sent_prompt_tokens"],
                            r["output_tokens"], r["oracle_hit_tokens"])
        assert [counts(a) for a, _ in pairs if a["turn"] == 0] == [
            counts(b) for _, b in pairs if b["turn"] == 0], workload
        if workload == "random":  # lengths drawn from [10, 30], as with a local tokenizer
            lengths = [r["prompt_tokens"] for r in _requests(served)]
            assert len(set(lengths)) > 1 and all(10 <= n <= 30 for n in lengths)


VLLM_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls",
    "latencies", "start_times", "generated_texts", "errors", "max_output_tokens_per_s",
    "max_concurrent_requests",
    *(f"{stat}_{metric}_ms" for stat in ("mean", "median", "std", "p50", "p90", "p99")
      for metric in ("ttft", "tpot", "itl", "e2el")),
}


def _check_vllm_result(r: dict, num_prompts: int, output_len: int) -> None:
    assert r.keys() >= VLLM_KEYS, VLLM_KEYS - r.keys()
    assert r["completed"] == r["num_prompts"] == num_prompts and r["failed"] == 0
    for key in ("ttfts", "itls", "latencies", "input_lens", "output_lens", "generated_texts",
                "errors"):
        assert len(r[key]) == r["completed"], key
    assert r["output_lens"] == [output_len] * num_prompts
    assert r["total_output_tokens"] == output_len * num_prompts
    assert r["total_input_tokens"] == sum(r["input_lens"]) and min(r["input_lens"]) > 0
    assert r["errors"] == [""] * num_prompts and all(r["generated_texts"])
    assert all(len(gaps) <= output_len - 1 for gaps in r["itls"])  # a chunk may be empty
    assert min(r["ttfts"]) > 0 and all(t < e for t, e in zip(r["ttfts"], r["latencies"]))
    assert r["request_throughput"] == pytest.approx(num_prompts / r["duration"])
    assert re.fullmatch(r"\d{8}-\d{6}", r["date"]) and r["model_id"] == MODEL
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < r[f"p50_{metric}_ms"] <= r[f"p90_{metric}_ms"] <= r[f"p99_{metric}_ms"]
    assert min(r["ttfts"]) * 1000 <= r["mean_ttft_ms"] <= max(r["ttfts"]) * 1000


@pytest.mark.slow
def test_save_result_vllm_writes_vllms_flat_json(server, tmp_path):
    # A sweep into --result-dir: one file per rate, named as vLLM names them.
    directory = tmp_path / "results"
    code = main(["bench", "serve", "--base-url", server, "--no-progress", "--save-result", "vllm",
                 "--result-dir", str(directory), "--num-requests", "4", "--input-len", "16",
                 "--output-len", "3", "--request-rate", "20,inf", "--concurrency", "2"])
    assert code == 0
    files = sorted(directory.iterdir())
    assert [re.sub(r"\d{8}-\d{6}", "DATE", f.name) for f in files] == [
        "openai-20.0qps-concurrency2-tiny-DATE.json", "openai-infqps-concurrency2-tiny-DATE.json"]
    for f, rate in zip(files, (20.0, "inf")):
        r = json.loads(f.read_text())
        _check_vllm_result(r, num_prompts=4, output_len=3)
        assert (r["request_rate"], r["max_concurrency"], r["backend"]) == (rate, 2, "openai")
        assert r["input_lens"] == [16] * 4 and r["max_concurrent_requests"] <= 2
    # Chat, to --output: a single run is one plain JSON object.
    code = main(["bench", "serve", "--base-url", server, "--no-progress", "--save-result", "vllm",
                 "--output", str(tmp_path / "chat.json"), "--workload", "multi-turn",
                 "--num-users", "2", "--num-turns", "2", "--prefix-len", "8", "--input-len", "8",
                 "--output-len", "3"])
    assert code == 0
    r = json.loads((tmp_path / "chat.json").read_text())
    _check_vllm_result(r, num_prompts=4, output_len=3)
    assert r["backend"] == r["endpoint_type"] == "openai-chat" and r["tokenizer_id"] == MODEL


class _Stub(BaseHTTPRequestHandler):
    """A server that lists ``server.models`` and has no other endpoint."""

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._answer(200, {"object": "list", "data": self.server.models})
        else:
            self._answer(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        self._answer(404, {"detail": "Not Found"})

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def _serving(handler: type[BaseHTTPRequestHandler], **state):
    """A ThreadingHTTPServer on a free loopback port, serving from a thread; ``state``
    becomes attributes of the server (its handlers read them as ``self.server.NAME``)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    for name, value in state.items():
        setattr(httpd, name, value)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def stub():
    with _serving(_Stub, models=[]) as httpd:
        yield httpd


def test_a_server_without_models_or_tokenize_is_a_clear_error(stub, tmp_path, capsys):
    base = f"http://127.0.0.1:{stub.server_address[1]}"
    out = tmp_path / "out.json"
    serve = ["bench", "serve", "--num-requests", "2", "--no-progress", "--output", str(out)]
    assert main([*serve, "--base-url", base]) == 2
    assert "lists no model" in capsys.readouterr().err
    stub.models = [{"id": "m", "object": "model"}]
    assert main([*serve, "--base-url", base]) == 2
    err = capsys.readouterr().err
    assert "model 'm' (from /v1/models)" in err and "no /tokenize endpoint" in err
    assert "--tokenizer" in err
    assert main([*serve, "--base-url", "http://127.0.0.1:9"]) == 2
    assert "cannot list the served models" in capsys.readouterr().err
    assert main([*serve, "--base-url", base, "--result-dir", str(tmp_path)]) == 2
    assert "give one or the other" in capsys.readouterr().err
    assert not out.exists()


class _Recorder(BaseHTTPRequestHandler):
    """An OpenAI-like streaming server that records every request body and, after
    ``server.delay`` seconds, streams one "x" per requested token, then the usage."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        time.sleep(self.server.delay)
        chat = self.path.endswith("/chat/completions")
        tokens = body.get("max_completion_tokens") or body["max_tokens"]
        choice = {"index": 0, "delta": {"content": "x"}} if chat else {"index": 0, "text": "x"}
        events = [{"choices": [choice]}] * tokens + [
            {"choices": [], "usage": {"prompt_tokens": 0, "completion_tokens": tokens}}]
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()  # HTTP/1.0: the body ends when the connection closes
            for event in events:
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
        except OSError:  # a client that gave up (--timeout) has closed the socket
            pass

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def recorder():
    with _serving(_Recorder, bodies=[], delay=0.0) as httpd:
        yield httpd


def test_request_flags_reach_the_wire_and_results_land_where_named(recorder, qwen3_checkpoint,
                                                                   tmp_path, capsys):
    """--no-ignore-eos, --shared-system-prompt and --timeout as the server sees them;
    --result-filename and `bench compare --markdown` on what was saved."""
    base = f"http://127.0.0.1:{recorder.server_address[1]}"
    run = ["bench", "serve", "--base-url", base, "--model", "m", "--tokenizer",
           str(qwen3_checkpoint), "--no-progress", "--input-len", "8", "--output-len", "3"]

    def bodies(*flags: str, code: int = 0) -> list[dict]:
        recorder.bodies.clear()
        assert main([*run, *flags]) == code
        return list(recorder.bodies)

    sent = bodies("--num-requests", "2", "--output", str(tmp_path / "plain.json"))
    assert [(b["ignore_eos"], b["min_tokens"], b["max_tokens"]) for b in sent] == [(True, 3, 3)] * 2
    sent = bodies("--num-requests", "2", "--no-ignore-eos", "--output", str(tmp_path / "eos.json"))
    assert len(sent) == 2 and not any({"ignore_eos", "min_tokens"} & b.keys() for b in sent)

    chat = ["--workload", "multi-turn", "--num-users", "3", "--num-turns", "1", "--prefix-len", "16"]
    systems = lambda sent: {b["messages"][0]["content"] for b in sent
                            if b["messages"][0]["role"] == "system"}
    assert len(systems(bodies(*chat, "--output", str(tmp_path / "own.json")))) == 3
    assert len(systems(bodies(*chat, "--shared-system-prompt",
                              "--output", str(tmp_path / "shared.json")))) == 1

    # --timeout: every request gives up after 0.3 s, long before the server's 3 s answer.
    recorder.delay = 3.0
    start = time.monotonic()
    assert main([*run, "--num-requests", "2", "--timeout", "0.3",
                 "--output", str(tmp_path / "late.json")]) == 1
    assert time.monotonic() - start < 2.5
    summary = json.loads((tmp_path / "late.json").read_text())["runs"][0]["summary"]
    assert summary["failed"] == 2 and "Timeout" in summary["errors"][0]
    recorder.delay = 0.0

    assert main([*run, "--num-requests", "2", "--save-result", "openinfer", "--result-dir",
                 str(tmp_path / "dir"), "--result-filename", "mine.json"]) == 0
    saved = tmp_path / "dir" / "mine.json"
    assert json.loads(saved.read_text())["runs"][0]["summary"]["completed"] == 2
    capsys.readouterr()
    assert main(["bench", "compare", str(saved), str(tmp_path / "plain.json"), "--markdown"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| metric | mine | plain |" and lines[1] == "|---|---|---|"
    assert all(line.startswith("| ") and line.endswith(" |") for line in lines[2:])
