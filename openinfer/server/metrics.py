"""Prometheus metrics of the server (names follow vLLM's, prefixed ``openinfer:``)."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from openinfer.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def stat(name: str) -> Callable[[], float]:
            return lambda: float(engine_stats().get(name, 0))

        Gauge("openinfer:num_requests_running", "Requests running in the engine",
              registry=r).set_function(stat("num_running"))
        Gauge("openinfer:num_requests_waiting", "Requests waiting in the engine",
              registry=r).set_function(stat("num_waiting"))
        Gauge("openinfer:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)",
              registry=r).set_function(stat("kv_cache_usage"))
        Gauge("openinfer:num_preemptions", "Preemptions since start",
              registry=r).set_function(stat("num_preemptions"))
        self.prompt_tokens = Counter("openinfer:prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter("openinfer:generation_tokens", "Generated tokens",
                                         registry=r)
        self.requests = Counter("openinfer:request_success", "Finished requests by reason",
                                ["finished_reason"], registry=r)
        Gauge("openinfer:prefix_cache_blocks", "Full blocks held in the device prefix cache",
              registry=r).set_function(stat("prefix_cache_blocks"))
        Gauge("openinfer:kv_host_blocks_used", "Blocks held in the host-memory KV tier (L2)",
              registry=r).set_function(stat("kv_host_blocks_used"))
        Gauge("openinfer:kv_store_bytes", "Bytes in the KV file store (L3), as this engine "
              "last counted them", registry=r).set_function(stat("kv_store_bytes"))
        Gauge("openinfer:num_requests_loading", "Waiting requests whose prefix is being read "
              "from the file store or pulled from a prefill instance",
              registry=r).set_function(stat("num_loading"))
        Gauge("openinfer:kv_leases", "Finished prompts whose KV a prefill instance holds for "
              "decode instances to pull", registry=r).set_function(stat("kv_leases"))
        r.register(_EngineCounters(engine_stats))
        self.ttft = Histogram("openinfer:time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("openinfer:inter_token_latency_seconds",
                             "Time between consecutive tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("openinfer:e2e_request_latency_seconds", "Arrival to finish",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self._last_token_time: dict[str, float] = {}

    def observe(self, out: RequestOutput) -> None:
        """Account one streaming delta (or an aborted request's final output)."""
        now = time.monotonic()
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        if new_tokens:
            self.generation_tokens.inc(new_tokens)
            last = self._last_token_time.get(out.request_id)
            if last is None and out.metrics is not None:
                self.ttft.observe(now - out.metrics.arrival_time)
            elif last is not None:
                # Several tokens in one delta share the gap.
                for _ in range(new_tokens):
                    self.itl.observe((now - last) / new_tokens)
            self._last_token_time[out.request_id] = now
        if out.finished:
            self._last_token_time.pop(out.request_id, None)
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            reasons = {c.finish_reason for c in out.outputs} or {"abort"}
            for reason in reasons:
                self.requests.labels(finished_reason=reason or "abort").inc()
            if out.metrics is not None:
                self.e2e.observe(now - out.metrics.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCounters(Collector):
    """Counters the engine core keeps itself (it reports running totals with each step)."""

    COUNTERS = (
        ("openinfer:prefix_cache_queries", "prefix_cache_queries",
         "Prompt tokens looked up in the prefix cache"),
        ("openinfer:prefix_cache_hits", "prefix_cache_hits",
         "Prompt tokens found in the prefix cache"),
    )

    def __init__(self, engine_stats: Callable[[], dict]) -> None:
        self.engine_stats = engine_stats

    TIER_COUNTERS = (
        ("openinfer:kv_store_read_failures", "kv_store_read_failures",
         "Store files rejected (corrupt, truncated, other model)"),
        ("openinfer:kv_host_stores_skipped", "kv_host_stores_skipped",
         "Cached blocks not offloaded to host memory (every slot pinned)"),
        ("openinfer:kv_store_writes_skipped", "kv_store_writes_skipped",
         "Blocks not written to the file store (the disk lagged too far behind)"),
        ("openinfer:kv_remote_blocks_pulled", "kv_remote_blocks_pulled",
         "Blocks a decode instance pulled from prefill instances"),
        ("openinfer:kv_remote_pull_failures", "kv_remote_pull_failures",
         "Pulls from prefill instances that failed (the rest was recomputed or failed)"),
        ("openinfer:kv_bytes_served", "kv_bytes_served",
         "Bytes a prefill instance sent to decode instances"),
    )
    LABELLED = (
        ("openinfer:prefix_cache_hits_by_tier", "prefix_cache_hits_by_tier", "tier",
         "Prompt tokens found in the prefix cache, by the tier that held them (L1 device, "
         "L2 host memory, L3 file store)"),
        ("openinfer:kv_transfer_bytes", "kv_transfer_bytes", "direction",
         "Bytes moved between KV tiers"),
        ("openinfer:kv_transfer_seconds", "kv_transfer_seconds", "direction",
         "Seconds spent moving KV between tiers"),
    )

    def collect(self):
        stats = self.engine_stats()
        for name, key, documentation in self.COUNTERS:
            yield CounterMetricFamily(name, documentation, value=float(stats.get(key, 0)))
        for name, key, label, documentation in self.LABELLED:
            family = CounterMetricFamily(name, documentation, labels=[label])
            for value_label, value in (stats.get(key) or {}).items():
                family.add_metric([value_label], float(value))
            yield family
        for name, key, documentation in self.TIER_COUNTERS:
            yield CounterMetricFamily(name, documentation, value=float(stats.get(key, 0)))
