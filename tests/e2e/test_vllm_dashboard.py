"""`openinfer serve --metrics-prefix vllm` as a real process: every query of the Grafana
dashboard vLLM ships finds a series of the served model, and a request's queue, prefill and
decode times add up to its end-to-end latency."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import MODEL, start_server, stop

QUERIES = Path(__file__).parent / "data" / "vllm_grafana_queries.txt"


def _dashboard_names() -> set[str]:
    """The metric names vLLM's dashboard queries select (as exposed: _total, _bucket, ...)."""
    queries = [line for line in QUERIES.read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    return {name for q in queries for name in re.findall(r"vllm:[a-zA-Z0-9_:]+", q)}


@pytest.fixture(scope="module")
def scraped(qwen3_checkpoint):
    """The server's metric families after two requests: a completion (6 tokens) and a
    streamed chat with n=2 (4 tokens each)."""
    base, proc = start_server(qwen3_checkpoint, "--metrics-prefix", "vllm")
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        client.completions.create(model=MODEL, prompt="hello there", max_tokens=6,
                                  extra_body={"ignore_eos": True})
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "count to four"}], max_tokens=4,
            n=2, stream=True, extra_body={"ignore_eos": True})
        for _ in stream:
            pass
        text = httpx.get(f"{base}/metrics", timeout=30).text
    finally:
        stop(proc)
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families: dict, name: str, **labels: str) -> float:
    """The one sample called ``name`` (with these labels) of the served model."""
    family = families[re.sub(r"_(total|bucket|sum|count)$", "", name)]
    values = [s.value for s in family.samples if s.name == name
              and s.labels.get("model_name") == MODEL
              and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(values) == 1, (name, labels, family.samples)
    return values[0]


@pytest.mark.slow
def test_every_query_of_vllms_grafana_dashboard_finds_a_series(scraped):
    names = _dashboard_names()
    assert len(names) >= 20  # the fixture file was read
    samples = [s for f in scraped.values() for s in f.samples]
    missing = sorted(n for n in names
                     if not any(s.name == n and s.labels.get("model_name") == MODEL
                                for s in samples))
    assert not missing, f"no series with model_name={MODEL!r} for {missing}"
    for name in names:  # and each is of the kind its query takes it for
        if name.endswith("_bucket"):
            assert scraped[name.removesuffix("_bucket")].type == "histogram", name
        elif name.endswith("_total"):
            assert scraped[name.removesuffix("_total")].type == "counter", name
    # The dashboard's $model_name variable: label_values(model_name).
    assert {s.labels.get("model_name") for s in samples} == {MODEL}
    assert {s.labels.get("engine") for s in samples} == {"0"}


@pytest.mark.slow
def test_request_counts_lengths_and_phase_times_add_up(scraped):
    v = lambda name, **labels: _value(scraped, name, **labels)  # noqa: E731
    assert v("vllm:request_success_total", finished_reason="length") == 2
    assert v("vllm:generation_tokens_total") == 6 + 2 * 4 == v("vllm:request_generation_tokens_sum")
    assert v("vllm:request_max_num_generation_tokens_sum") == 6 + 4
    assert v("vllm:prompt_tokens_total") == v("vllm:request_prompt_tokens_sum") > 0
    assert v("vllm:request_params_n_sum") == 1 + 2
    assert v("vllm:request_params_max_tokens_sum") == 6 + 4
    assert v("vllm:inter_token_latency_seconds_count") == (6 - 1) + 2 * (4 - 1)
    phases = ("request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_inference_time_seconds",
              "e2e_request_latency_seconds", "time_to_first_token_seconds")
    sums = {p: v(f"vllm:{p}_sum") for p in phases}
    for p in phases:
        assert v(f"vllm:{p}_count") == 2, p
        assert sums[p] >= 0, p
    assert sums["request_prefill_time_seconds"] > 0
    # Per request: queue + prefill + decode = e2e, prefill + decode = inference, and
    # queue + prefill = TTFT (the core's scheduling time sits between the front end's).
    queue, prefill, decode = (sums[p] for p in phases[:3])
    assert queue + prefill + decode == pytest.approx(sums["e2e_request_latency_seconds"], rel=1e-6)
    assert prefill + decode == pytest.approx(sums["request_inference_time_seconds"], rel=1e-6)
    assert queue + prefill == pytest.approx(sums["time_to_first_token_seconds"], rel=1e-6)
    info = next(s for s in scraped["vllm:cache_config_info"].samples)
    assert info.value == 1 and info.labels["block_size"] == "16"
    assert int(info.labels["num_gpu_blocks"]) > 0
    assert info.labels["enable_prefix_caching"] == "True"
    compute = next(s for s in scraped["vllm:compute_info"].samples)
    assert compute.value == 1 and compute.labels["dtype"] == "float32"
    assert compute.labels["gemm"] and compute.labels["cpu_capability"] and compute.labels["attention"]
