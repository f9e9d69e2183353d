"""`--save-result vllm`: vLLM's flat result JSON, checked on a hand-made run."""

from __future__ import annotations

import math

import pytest

from openinfer.bench.client import RequestResult
from openinfer.bench.vllm_result import vllm_file_name, vllm_result


def _run() -> list[RequestResult]:
    # a: sent at 0.0 s, chunks at 0.5, 0.7, 0.9, 1.1; b: sent at 0.2 s, chunks at 0.5, 1.5, 1.6;
    # c failed.
    a = RequestResult(0, 0, 0.0, ok=True, ttft_s=0.5, e2e_s=1.1, itl_s=[0.2, 0.2, 0.2],
                      text="abcd", prompt_tokens=10, output_tokens=4, sent_prompt_tokens=10)
    b = RequestResult(1, 0, 0.2, ok=True, ttft_s=0.3, e2e_s=1.4, itl_s=[1.0, 0.1],
                      text="xyz", prompt_tokens=20, output_tokens=3, sent_prompt_tokens=20)
    c = RequestResult(2, 0, 0.3, error="HTTP 500: boom", sent_prompt_tokens=30)
    return [a, b, c]


def test_vllm_keys_values_and_conventions():
    r = vllm_result(_run(), 2.0, endpoint="chat", model_id="org/Model-7B", tokenizer_id="org/tok",
                    request_rate=math.inf, arrival="poisson", max_concurrency=None, goodput=None,
                    date="20260101-120000")
    assert (r["backend"], r["endpoint_type"], r["model_id"], r["tokenizer_id"]) == (
        "openai-chat", "openai-chat", "org/Model-7B", "org/tok")
    assert (r["num_prompts"], r["completed"], r["failed"]) == (3, 2, 1)
    assert (r["request_rate"], r["burstiness"], r["max_concurrency"]) == ("inf", 1.0, None)
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (30, 7)
    assert r["request_throughput"] == 1.0 and r["output_throughput"] == 3.5
    assert r["total_token_throughput"] == 18.5 and r["request_goodput"] is None
    assert r["input_lens"] == [10, 20, 30] and r["output_lens"] == [4, 3, 0]
    assert r["ttfts"] == [0.5, 0.3, 0.0] and r["latencies"] == [1.1, 1.4, 0.0]
    assert r["itls"] == [[0.2, 0.2, 0.2], [1.0, 0.1], []]
    assert r["generated_texts"] == ["abcd", "xyz", ""]
    assert r["errors"] == ["", "", "HTTP 500: boom"]
    assert r["start_times"] == [0.0, 0.2, 0.3]
    # In milliseconds, over the completed requests; TPOT = (E2E - TTFT) / (output - 1).
    assert r["mean_ttft_ms"] == pytest.approx(400) and r["median_ttft_ms"] == pytest.approx(400)
    assert r["std_ttft_ms"] == pytest.approx(100)
    assert r["mean_tpot_ms"] == pytest.approx((200 + 550) / 2)
    assert r["median_itl_ms"] == pytest.approx(200) and r["p99_e2el_ms"] == pytest.approx(1397, 1e-3)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert r[f"p50_{metric}_ms"] <= r[f"p90_{metric}_ms"] <= r[f"p99_{metric}_ms"]
        assert r[f"p50_{metric}_ms"] == r[f"median_{metric}_ms"]
    # Chunks per whole second from the first send: 0.5, 0.7, 0.9 (a) and 0.5 (b) in second 0;
    # 1.1 (a), 1.5 and 1.6 (b) in second 1. a [0, 1.1) and b [0.2, 1.6) overlap.
    assert r["max_output_tokens_per_s"] == 4.0 and r["max_concurrent_requests"] == 2
    assert vllm_file_name(r) == "openai-chat-infqps-Model-7B-20260101-120000.json"


def test_vllm_rate_concurrency_arrival_and_an_all_failed_run():
    r = vllm_result([RequestResult(0, 0, 0.0, error="x")], 1.0, endpoint="completions",
                    model_id="tiny", tokenizer_id="tiny", request_rate=4, arrival="fixed",
                    max_concurrency=8, goodput=0.0, date="20260101-120000")
    assert (r["request_rate"], r["burstiness"], r["request_goodput"]) == (4, math.inf, 0.0)
    assert (r["completed"], r["max_output_tokens_per_s"], r["max_concurrent_requests"]) == (0, 0.0, 0)
    assert r["mean_ttft_ms"] == 0.0 and r["p99_itl_ms"] == 0.0  # vLLM's np.mean(x or 0)
    assert vllm_file_name(r) == "openai-4.0qps-concurrency8-tiny-20260101-120000.json"
