"""ServerMetrics on its own: vLLM's names, types and labels under any prefix, and what each
request adds to them (no engine, no process)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

import openinfer.server.metrics as metrics_module
from openinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from openinfer.sampling_params import SamplingParams
from openinfer.server.metrics import ServerMetrics, metric_prefix, token_buckets

CACHE_INFO = {"block_size": "16", "num_gpu_blocks": "512", "num_cpu_blocks": "None",
              "enable_prefix_caching": "True", "cache_dtype": "float32"}

# What vLLM's V1 front end exposes, as exposition names and types.
VLLM_SERIES = {
    "num_requests_running": "gauge",
    "num_requests_waiting": "gauge",
    "kv_cache_usage_perc": "gauge",
    "cache_config_info": "gauge",
    "prompt_tokens_total": "counter",
    "generation_tokens_total": "counter",
    "request_success_total": "counter",
    "num_preemptions_total": "counter",
    "prefix_cache_queries_total": "counter",
    "prefix_cache_hits_total": "counter",
    "time_to_first_token_seconds": "histogram",
    "inter_token_latency_seconds": "histogram",
    "request_time_per_output_token_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram",
    "request_queue_time_seconds": "histogram",
    "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram",
    "request_inference_time_seconds": "histogram",
    "request_prompt_tokens": "histogram",
    "request_generation_tokens": "histogram",
    "request_max_num_generation_tokens": "histogram",
    "request_params_n": "histogram",
    "request_params_max_tokens": "histogram",
}


def _metrics(stats: dict | None = None, prefix: str = "vllm", engine: str = "3") -> ServerMetrics:
    return ServerMetrics(lambda: stats or {}, model_name="my-model", engine=engine, prefix=prefix,
                         max_model_len=1000, cache_info=lambda: dict(CACHE_INFO))


def _types(text: str) -> dict[str, str]:
    """Exposition name -> type, from the # TYPE lines (each must appear once)."""
    lines = [line.split()[2:] for line in text.splitlines() if line.startswith("# TYPE ")]
    types = dict(lines)
    assert len(types) == len(lines), "a metric family appears twice"
    return types


def _samples(m: ServerMetrics) -> dict[str, float]:
    """Sample name + [other label values] -> value (the model_name/engine labels checked)."""
    values = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            assert s.labels["model_name"] == "my-model" and s.labels["engine"] == "3", s
            rest = "".join(f"[{v}]" for k, v in s.labels.items() if k not in ("model_name", "engine"))
            values[s.name + rest] = s.value
    return values


def test_vllm_names_types_and_labels_on_every_series():
    stats = {"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.25, "num_preemptions": 3,
             "prefix_cache_queries": 40, "prefix_cache_hits": 16,
             "prefix_cache_hits_by_tier": {"L1": 16}, "kv_transfer_bytes": {"host_to_device": 8}}
    m = _metrics(stats)
    types = _types(m.render().decode())
    for name, kind in VLLM_SERIES.items():
        assert types.get("vllm:" + name) == kind, name
    assert all(name.startswith("vllm:") for name in types)
    # No creation-timestamp series beside the counters and histograms.
    assert "_created" not in m.render().decode()
    # openinfer's own series ride along, under the same prefix and labels.
    assert types["vllm:kv_transfer_bytes_total"] == "counter"
    assert types["vllm:prefix_cache_blocks"] == "gauge"
    values = _samples(m)  # asserts model_name and engine on every sample
    assert values["vllm:num_requests_running"] == 2
    assert values["vllm:num_requests_waiting"] == 1
    assert values["vllm:kv_cache_usage_perc"] == 0.25
    assert values["vllm:num_preemptions_total"] == 3
    assert values["vllm:prefix_cache_queries_total"] == 40
    assert values["vllm:prefix_cache_hits_total"] == 16
    assert values["vllm:prefix_cache_hits_by_tier_total[L1]"] == 16
    assert values["vllm:kv_transfer_bytes_total[host_to_device]"] == 8
    for reason in ("stop", "length", "abort", "error"):  # there from the start, at 0
        assert values[f"vllm:request_success_total[{reason}]"] == 0
    info = next(f for f in text_string_to_metric_families(m.render().decode())
                if f.name == "vllm:cache_config_info").samples
    assert len(info) == 1 and info[0].value == 1
    assert info[0].labels == {"model_name": "my-model", "engine": "3", **CACHE_INFO}


def test_compute_info_series():
    compute = {"dtype": "bfloat16", "gemm": "onednn_packed+torch", "cpu_capability": "AVX512",
               "attention": "cpu"}
    m = ServerMetrics(dict, model_name="my-model", engine="3", prefix="vllm",
                      compute_info=lambda: dict(compute))
    families = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    (sample,) = families["vllm:compute_info"].samples
    assert families["vllm:compute_info"].type == "gauge" and sample.value == 1
    assert sample.labels == {"model_name": "my-model", "engine": "3", **compute}
    # Until the engine core has reported (or without a reporter), no sample.
    empty = ServerMetrics(dict, model_name="my-model", engine="3", prefix="vllm")
    families = {f.name: f for f in text_string_to_metric_families(empty.render().decode())}
    assert not families.get("vllm:compute_info") or not families["vllm:compute_info"].samples


def test_prefix_default_any_and_invalid():
    assert metric_prefix("vllm") == metric_prefix("vllm:") == "vllm:"
    text = ServerMetrics(dict, model_name="x").render().decode()
    assert "# TYPE openinfer:num_preemptions_total counter" in text
    assert 'openinfer:num_requests_running{engine="0",model_name="x"} 0.0' in text
    assert "# TYPE acme_llm:generation_tokens_total counter" in _metrics(
        prefix="acme_llm").render().decode()
    for bad in ("my-prefix", "9lives", "", "a b"):
        with pytest.raises(ValueError, match="metrics-prefix"):
            _metrics(prefix=bad)


def test_token_buckets():
    assert token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_buckets(4096)[-1] == 2000


def _delta(request_id: str, metrics: RequestMetrics, samples: list[tuple[int, int, str | None]],
           prompt_len: int = 7, finished: bool = False) -> RequestOutput:
    """A streaming delta: (sample index, new tokens, finish reason) per sample."""
    outputs = [CompletionOutput(i, "x" * k, list(range(k)), finish_reason=reason)
               for i, k, reason in samples]
    return RequestOutput(request_id, None, list(range(prompt_len)), outputs, finished=finished,
                         metrics=metrics)


def test_a_request_fills_vllm_timing_and_length_histograms(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: clock[0])
    m = _metrics()
    times = RequestMetrics(arrival_time=100.0)
    m.on_request("r", SamplingParams(max_tokens=4))
    clock[0] = 100.5
    times.first_scheduled_time, times.first_token_time = 100.25, 100.5
    m.observe(_delta("r", times, [(0, 1, None)]))
    clock[0] = 100.7
    m.observe(_delta("r", times, [(0, 2, None)]))  # two tokens in one delta: 0.1 s each
    clock[0] = 101.0
    times.finished_time = 101.0
    m.observe(_delta("r", times, [(0, 1, "length")], finished=True))
    v = _samples(m)
    assert v["vllm:prompt_tokens_total"] == 7  # once, with the first token
    assert v["vllm:generation_tokens_total"] == 4
    assert v["vllm:request_success_total[length]"] == 1
    assert v["vllm:request_success_total[stop]"] == 0
    assert v["vllm:time_to_first_token_seconds_sum"] == pytest.approx(0.5)
    assert v["vllm:request_queue_time_seconds_sum"] == pytest.approx(0.25)
    assert v["vllm:request_prefill_time_seconds_sum"] == pytest.approx(0.25)
    assert v["vllm:request_decode_time_seconds_sum"] == pytest.approx(0.5)
    assert v["vllm:request_inference_time_seconds_sum"] == pytest.approx(0.75)
    assert v["vllm:e2e_request_latency_seconds_sum"] == pytest.approx(1.0)
    assert v["vllm:inter_token_latency_seconds_count"] == 3
    assert v["vllm:inter_token_latency_seconds_sum"] == pytest.approx(0.5)
    assert v["vllm:request_time_per_output_token_seconds_sum"] == pytest.approx(0.5 / 3)
    assert v["vllm:request_prompt_tokens_sum"] == 7
    assert v["vllm:request_prompt_tokens_bucket[10.0]"] == 1
    assert v["vllm:request_prompt_tokens_bucket[5.0]"] == 0
    assert v["vllm:request_generation_tokens_sum"] == 4
    assert v["vllm:request_max_num_generation_tokens_sum"] == 4
    assert v["vllm:request_params_max_tokens_sum"] == 4
    assert v["vllm:request_params_n_sum"] == 1
    assert v["vllm:e2e_request_latency_seconds_bucket[1.0]"] == 1
    assert v["vllm:e2e_request_latency_seconds_bucket[0.8]"] == 0
    assert not m._requests  # nothing kept once it finished


def test_parallel_samples_count_once_and_an_abort_counts_as_abort():
    m = _metrics()
    times = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.1, first_token_time=1.2,
                           finished_time=2.0)
    m.on_request("n2", SamplingParams(n=2, max_tokens=8))
    m.observe(_delta("n2", times, [(0, 1, None), (1, 1, None)]))
    m.observe(_delta("n2", times, [(0, 2, "stop")]))
    m.observe(_delta("n2", times, [(1, 5, "length")], finished=True))
    # Aborted before it was scheduled: AsyncLLM.abort's final output, no tokens.
    m.on_request("gone", SamplingParams(max_tokens=None))
    m.observe(_delta("gone", RequestMetrics(arrival_time=1.0, finished_time=1.5),
                     [(0, 0, "abort")], finished=True))
    v = _samples(m)
    assert v["vllm:request_success_total[length]"] == 1  # length outranks stop
    assert v["vllm:request_success_total[abort]"] == 1
    assert v["vllm:request_generation_tokens_sum"] == 9  # both samples
    assert v["vllm:request_max_num_generation_tokens_sum"] == 6  # the longer
    assert v["vllm:request_params_n_sum"] == 3
    assert v["vllm:request_params_n_bucket[2.0]"] == 2
    assert v["vllm:request_params_max_tokens_count"] == 1  # None (the context) is left out
    assert v["vllm:prompt_tokens_total"] == 7  # the aborted one never reached prefill's end
    assert v["vllm:e2e_request_latency_seconds_count"] == 2
    assert v["vllm:request_queue_time_seconds_count"] == 1  # only the scheduled one
    assert v["vllm:request_decode_time_seconds_count"] == 1
    assert v["vllm:time_to_first_token_seconds_count"] == 1
