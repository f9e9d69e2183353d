"""The router's reading of replica metrics: load under any prefix, and the merged re-export
(no processes: replicas are ServerMetrics renders, served by an httpx mock transport)."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from openinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from openinfer.router.metrics import cluster_exposition, merge_expositions, replica_load
from openinfer.server.metrics import ServerMetrics


def _replica_text(prefix: str, running: int, waiting: int, usage: float, tokens: int = 0) -> str:
    m = ServerMetrics(lambda: {"num_running": running, "num_waiting": waiting,
                               "kv_cache_usage": usage}, model_name="tiny model", prefix=prefix)
    if tokens:
        m.observe(RequestOutput("r", None, [1, 2], [CompletionOutput(0, "", list(range(tokens)))],
                                metrics=RequestMetrics(arrival_time=0.0)))
    return m.render().decode()


def test_replica_load_reads_any_prefix_and_labels():
    for prefix in ("openinfer", "vllm", "acme"):
        assert replica_load(_replica_text(prefix, 3, 2, 0.5)) == (5, 0.5)
    # Unlabelled (an older replica), several engines, junk: all read or skipped, never raised.
    text = ("openinfer:num_requests_running 4.0\n"
            'vllm:num_requests_waiting{engine="0"} 1\nvllm:num_requests_waiting{engine="1"} 2\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.2\nvllm:kv_cache_usage_perc{engine="1"} 0.7\n'
            "vllm:num_requests_running_total 100\nnot a metric line {\n"
            "vllm:num_requests_running NaN-ish\n")
    assert replica_load(text) == (7, 0.7)
    assert replica_load("") == (0, 0.0)


def test_merge_labels_each_replica_by_engine_and_keeps_one_family_each():
    texts = {"0": _replica_text("vllm", 1, 0, 0.1, tokens=3),
             "1": _replica_text("vllm", 2, 5, 0.3, tokens=4)
             + "# TYPE openinfer_router:decisions_total counter\nopeninfer_router:decisions_total 9\n",
             "2": "this is { not prometheus text"}
    registry = CollectorRegistry()
    Counter("openinfer_router:decisions", "x", ["reason"], registry=registry).labels("rr").inc()
    body = asyncio.run(cluster_exposition(_mock_http(texts), {e: f"http://r{e}" for e in texts},
                                          registry)).decode()
    type_lines = [line for line in body.splitlines() if line.startswith("# TYPE ")]
    assert len(type_lines) == len(set(type_lines))  # one family block per name
    assert "# TYPE vllm:generation_tokens_total counter" in type_lines
    assert "# TYPE vllm:e2e_request_latency_seconds histogram" in type_lines
    families = {f.name: f for f in text_string_to_metric_families(body)}
    assert [s.value for s in families["openinfer_router:decisions"].samples
            if s.name.endswith("_total")] == [1]  # the router's own, not a replica's
    running = {s.labels["engine"]: s.value for s in families["vllm:num_requests_running"].samples}
    assert running == {"0": 1, "1": 2}  # the unparseable replica left out
    generated = {s.labels["engine"]: s.value for s in families["vllm:generation_tokens"].samples
                 if s.name.endswith("_total")}
    assert generated == {"0": 3, "1": 4}
    assert {s.labels["model_name"] for s in families["vllm:num_requests_waiting"].samples} \
        == {"tiny model"}
    buckets = [s for s in families["vllm:request_prompt_tokens"].samples
               if s.name.endswith("_bucket")]
    assert {s.labels["engine"] for s in buckets} == {"0", "1"} and all("le" in s.labels
                                                                   for s in buckets)


def test_merge_overrides_the_engine_label_and_skips_a_type_clash():
    same = _replica_text("vllm", 1, 0, 0.0)  # both say engine="0"
    clash = same.replace("# TYPE vllm:num_requests_running gauge",
                         "# TYPE vllm:num_requests_running untyped")
    merged = {f.name: f for f in merge_expositions({"0": same, "1": clash})}
    assert {s.labels["engine"] for s in merged["vllm:num_requests_waiting"].samples} == {"0", "1"}
    assert {s.labels["engine"] for s in merged["vllm:num_requests_running"].samples} == {"0"}


def _mock_http(texts: dict[str, str]) -> httpx.AsyncClient:
    def answer(request: httpx.Request) -> httpx.Response:
        engine = request.url.host.removeprefix("r")
        if request.url.path != "/metrics":
            return httpx.Response(404)
        return httpx.Response(200, text=texts[engine])

    return httpx.AsyncClient(transport=httpx.MockTransport(answer))


def test_a_replica_that_fails_its_scrape_is_left_out():
    texts = {"0": _replica_text("openinfer", 1, 1, 0.0)}

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.host == "down":
            raise httpx.ConnectError("refused")
        if request.url.host == "sick":
            return httpx.Response(503, text="openinfer:num_requests_running 99\n")
        return httpx.Response(200, text=texts["0"])

    http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    body = asyncio.run(cluster_exposition(http, {"0": "http://up", "1": "http://down",
                                                 "2": "http://sick"}, CollectorRegistry()))
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert [s.labels["engine"] for s in families["openinfer:num_requests_running"].samples] == ["0"]
