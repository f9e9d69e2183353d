"""Prometheus metrics of the API server, named, typed, labelled and bucketed as vLLM's.

Every series is ``<prefix>:<name>``: prefix ``openinfer`` by default, ``vllm`` for vLLM's
Grafana dashboards and alerts to work unchanged (``serve --metrics-prefix``). Every series
carries ``model_name`` (the served model name) and ``engine`` (this server's data-parallel
rank, "0" for a lone server). Counters end in ``_total``. What each series reads:

* the engine core's stats, sent with every step (gauges, and counters it keeps as running
  totals): read at scrape time by ``_EngineStats``;
* each request's acceptance (``on_request``: its n and max_tokens) and its output deltas
  (``observe``: tokens, latencies, lengths, finish reasons), seen in this process;
* ``cache_config_info``: the KV cache's configuration as labels of a gauge set to 1;
* ``compute_info``: how the engine computes (dtype, GEMM paths, CPU capability, attention
  backend, huge pages, the caching CPU allocator's limit, CUDA graphs), as the engine core reported it
  when ready, the same way.

A request's timing comes from its RequestMetrics (monotonic seconds; the scheduling time
is the engine core's, on the same host's clock):

    arrival --queue--> first scheduled --prefill--> first token --decode--> finished
       |                      |------------------- inference -------------------|
       |---------------------------------- e2e ---------------------------------|

Request-level series count a request once whatever its ``n`` (vLLM counts each of its n
samples): its generation length sums its samples, ``request_max_num_generation_tokens``
takes the longest, and its finish reason is the first of abort, error, length, stop that
one of its samples ended with.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from openinfer.outputs import RequestOutput
from openinfer.sampling_params import SamplingParams

# No ``*_created`` series (prometheus_client's default): a creation timestamp for every
# counter and histogram, half the series types, which neither vLLM's dashboards nor ours read.
disable_created_metrics()

if TYPE_CHECKING:
    from openinfer.engine.async_llm import AsyncLLM

LABELS = ("model_name", "engine")
"""The labels of every series, in this order (a series' own labels follow them)."""
FINISH_REASONS = ("abort", "error", "length", "stop")
"""A request's finish reason; with several samples, the first of these that one ended with."""

# Bucket bounds (seconds, or tokens) as vLLM's V1 front end uses them, so that quantiles
# computed from openinfer and from vLLM compare bucket for bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)

_PREFIX = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_prefix(prefix: str) -> str:
    """``prefix`` as the start of a metric name: 'vllm' (or 'vllm:') -> 'vllm:'.
    Raises ValueError unless it is a valid Prometheus metric name."""
    name = prefix.removesuffix(":")
    if not _PREFIX.fullmatch(name):
        raise ValueError(f"--metrics-prefix {prefix!r} is not a valid Prometheus metric name "
                         "(letters, digits, '_' and ':', not starting with a digit)")
    return name + ":"


def token_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (token-count histograms)."""
    bounds, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(bounds)
            bounds.append(mantissa * scale)
        scale *= 10


@dataclass
class _Tracked:
    """What the metrics remember of a request between its deltas (per sample index)."""

    last_token_time: dict[int, float] = field(default_factory=dict)
    num_tokens: dict[int, int] = field(default_factory=dict)
    reasons: set[str] = field(default_factory=set)
    first_token_seen: bool = False


class ServerMetrics:
    """The server's registry. Feed it ``on_request`` when a request is accepted and
    ``observe`` with every delta of it (AsyncLLM's observer hooks; ``for_llm`` wires them);
    ``render`` is the /metrics body."""

    def __init__(self, engine_stats: Callable[[], dict], *, model_name: str, engine: str = "0",
                 prefix: str = "openinfer", max_model_len: int = 4096,
                 cache_info: Callable[[], dict[str, str]] | None = None,
                 compute_info: Callable[[], dict[str, str]] | None = None) -> None:
        """``engine_stats``: the core's latest stats (EngineCore.stats()); ``cache_info``:
        the labels of ``cache_config_info`` (block_size, num_gpu_blocks, ...), and
        ``compute_info`` those of ``compute_info`` (EngineCore.compute_info; no series while
        empty), read at each scrape. Raises ValueError for a prefix that cannot start a
        metric name."""
        self.prefix = metric_prefix(prefix)
        self.registry = CollectorRegistry()
        self._values = (model_name, str(engine))
        p, r = self.prefix, self.registry

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(p + name, doc, [*LABELS, *labels], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(p + name, doc, LABELS, buckets=buckets, registry=r).labels(*self._values)

        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed "
                                     "(a request's whole prompt, when its first token comes).") \
            .labels(*self._values)
        self.generation_tokens = counter("generation_tokens",
                                         "Number of generation tokens processed.").labels(*self._values)
        success = counter("request_success", "Count of finished requests by finish reason.",
                          "finished_reason")
        self.request_success = {reason: success.labels(*self._values, reason)
                                for reason in FINISH_REASONS}
        self.ttft = histogram("time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Histogram of a request's mean time per output token (decode time "
                              "over its tokens after the first) in seconds.",
                              TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.",
                               REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.",
                                   REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.",
                                 REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.",
                                REQUEST_LATENCY_BUCKETS)
        lengths = token_buckets(max_model_len)
        self.prompt_len = histogram("request_prompt_tokens", "Number of prefill tokens processed.",
                                    lengths)
        self.generation_len = histogram("request_generation_tokens",
                                        "Number of generation tokens processed.", lengths)
        self.max_generation_len = histogram("request_max_num_generation_tokens",
                                            "Histogram of maximum number of requested generation "
                                            "tokens.", lengths)
        self.param_n = histogram("request_params_n", "Histogram of the n request parameter.",
                                 N_BUCKETS)
        self.param_max_tokens = histogram("request_params_max_tokens",
                                          "Histogram of the max_tokens request parameter.", lengths)
        r.register(_EngineStats(p, self._values, engine_stats))
        r.register(_InfoSeries(p + "cache_config_info", "Information of the LLMEngine CacheConfig",
                               self._values, cache_info or dict))
        r.register(_InfoSeries(p + "compute_info", "How the engine computes: dtype, GEMM paths "
                               "(openinfer.kernels.gemm_plan), CPU capability, attention backend, "
                               "huge pages, bytes the caching CPU allocator may keep, largest "
                               "decode batch replayed as a CUDA graph, the routed experts' path "
                               "(+fp8, +fp4: fp8 or MXFP4 weights)",
                               self._values, compute_info or dict, skip_empty=True))
        self._requests: dict[str, _Tracked] = {}

    @classmethod
    def for_llm(cls, llm: AsyncLLM, model_name: str, *, prefix: str = "openinfer",
                engine: str = "0") -> ServerMetrics:
        """Metrics of ``llm``'s server, registered as its observers."""
        config = llm.config

        def cache_info() -> dict[str, str]:
            return {"block_size": str(config.cache.block_size),
                    "num_gpu_blocks": str(llm.client.info.get("num_blocks")),
                    "num_cpu_blocks": str(llm.client.stats.get("kv_host_blocks_total")),
                    "enable_prefix_caching": str(config.cache.enable_prefix_caching),
                    "cache_dtype": (config.cache.kv_cache_dtype if config.cache.kv_cache_dtype != "auto"
                                    else str(config.model.dtype).removeprefix("torch."))}

        def compute_info() -> dict[str, str]:
            return {k: str(v) for k, v in (llm.client.info.get("compute_info") or {}).items()}

        metrics = cls(lambda: llm.client.stats, model_name=model_name, engine=engine,
                      prefix=prefix, max_model_len=config.model.max_model_len,
                      cache_info=cache_info, compute_info=compute_info)
        llm.request_observers.append(metrics.on_request)
        llm.observers.append(metrics.observe)
        return metrics

    def on_request(self, request_id: str, params: SamplingParams) -> None:
        """A request was accepted: its parameters."""
        self._requests[request_id] = _Tracked()
        self.param_n.observe(params.n)
        if params.max_tokens is not None:
            self.param_max_tokens.observe(params.max_tokens)

    def observe(self, out: RequestOutput) -> None:
        """Account one streaming delta, or an aborted request's final output (finished)."""
        now = time.monotonic()
        tracked = self._requests.setdefault(out.request_id, _Tracked())
        new_tokens = 0
        for c in out.outputs:
            if c.finish_reason is not None:
                tracked.reasons.add(c.finish_reason)
            if not c.token_ids:
                continue
            k = len(c.token_ids)
            new_tokens += k
            tracked.num_tokens[c.index] = tracked.num_tokens.get(c.index, 0) + k
            last = tracked.last_token_time.get(c.index)
            if last is not None:  # several tokens in one delta share the gap
                for _ in range(k):
                    self.itl.observe((now - last) / k)
            tracked.last_token_time[c.index] = now
        m = out.metrics
        if new_tokens:
            self.generation_tokens.inc(new_tokens)
            if not tracked.first_token_seen:
                tracked.first_token_seen = True
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                if m is not None:
                    first = m.first_token_time if m.first_token_time is not None else now
                    self.ttft.observe(max(0.0, first - m.arrival_time))
        if out.finished:
            del self._requests[out.request_id]
            self._finish(out, tracked, now)

    def _finish(self, out: RequestOutput, tracked: _Tracked, now: float) -> None:
        reason = next((r for r in FINISH_REASONS if r in tracked.reasons), "abort")
        self.request_success[reason].inc()
        self.prompt_len.observe(len(out.prompt_token_ids))
        self.generation_len.observe(sum(tracked.num_tokens.values()))
        longest = max(tracked.num_tokens.values(), default=0)
        self.max_generation_len.observe(longest)
        m = out.metrics
        if m is None:
            return
        end = m.finished_time if m.finished_time is not None else now
        self.e2e.observe(max(0.0, end - m.arrival_time))
        scheduled, first = m.first_scheduled_time, m.first_token_time
        if scheduled is not None:
            self.queue.observe(max(0.0, scheduled - m.arrival_time))
            self.inference.observe(max(0.0, end - scheduled))
            if first is not None:
                self.prefill.observe(max(0.0, first - scheduled))
        if first is not None:
            self.decode.observe(max(0.0, end - first))
            if longest > 1:
                self.tpot.observe(max(0.0, end - first) / (longest - 1))

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry)


class _EngineStats(Collector):
    """Series read from the engine core's stats (EngineCore.stats(); absent keys read 0)."""

    # (name, stats key, help): gauges, then counters the core keeps as running totals.
    GAUGES = (
        ("num_requests_running", "num_running", "Number of requests in model execution batches."),
        ("num_requests_waiting", "num_waiting", "Number of requests waiting to be processed."),
        ("kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
        ("num_requests_loading", "num_loading", "Waiting requests whose prefix is being read "
         "from the file store or pulled from a prefill instance"),
        ("prefix_cache_blocks", "prefix_cache_blocks", "Full blocks held in the device prefix "
         "cache"),
        ("kv_host_blocks_used", "kv_host_blocks_used", "Blocks held in the host-memory KV tier "
         "(L2)"),
        ("kv_store_bytes", "kv_store_bytes", "Bytes in the KV file store (L3), as this engine "
         "last counted them"),
        ("kv_leases", "kv_leases", "Finished prompts whose KV a prefill instance holds for "
         "decode instances to pull"),
        ("kv_pinned_blocks", "kv_pinned_blocks", "Blocks pinned by prompt caching or tool-call "
         "retention, until their TTLs end"),
        ("gc_frozen_objects", "gc_frozen_objects", "Objects the engine-core process froze out "
         "of Python's garbage collection at start-up"),
    )
    COUNTERS = (
        ("num_preemptions", "num_preemptions", "Cumulative number of preemption from the engine."),
        ("prefix_cache_queries", "prefix_cache_queries",
         "Prefix cache queries, in terms of number of queried tokens."),
        ("prefix_cache_hits", "prefix_cache_hits",
         "Prefix cache hits, in terms of number of cached tokens."),
        ("kv_store_read_failures", "kv_store_read_failures",
         "Store files rejected (corrupt, truncated, other model)"),
        ("kv_pins_refused", "kv_pins_refused",
         "Pins not taken because they would pass --kv-pin-memory (per key or in all)"),
        ("kv_host_stores_skipped", "kv_host_stores_skipped",
         "Cached blocks not offloaded to host memory (every slot pinned)"),
        ("kv_store_writes_skipped", "kv_store_writes_skipped",
         "Blocks not written to the file store (the disk lagged too far behind)"),
        ("kv_store_write_failures", "kv_store_write_failures",
         "Blocks the file store's disk refused (full, read-only, directory removed)"),
        ("kv_remote_blocks_pulled", "kv_remote_blocks_pulled",
         "Blocks a decode instance pulled from prefill instances"),
        ("kv_remote_pull_failures", "kv_remote_pull_failures",
         "Pulls from prefill instances that failed (the rest was recomputed or failed)"),
        ("kv_bytes_served", "kv_bytes_served", "Bytes a prefill instance sent to decode instances"),
        ("kv_transfer_rejected", "kv_transfer_rejected",
         "KV server connections refused and closed (unknown lease, wrong secret, bad request)"),
        ("kv_leases_expired", "kv_leases_expired",
         "KV leases that timed out unreleased (no decode instance pulled and let go)"),
        ("window_replayed_tokens", "window_replayed_tokens",
         "Prefix-hit tokens recomputed because no window snapshot was cached at their end "
         "(sliding-window models)"),
        ("eplb_rearrangements", "eplb_rearrangements",
         "Times EPLB placed the experts again (--enable-eplb)"),
        ("eplb_experts_moved", "eplb_experts_moved",
         "Expert replicas EPLB sent from one rank to another"),
        ("eplb_bytes_moved", "eplb_bytes_moved", "Expert weight bytes EPLB sent between ranks"),
        ("spec_decode_num_drafts", "spec_num_drafts",
         "Speculative decoding: request steps that verified at least one draft token"),
        ("spec_decode_num_draft_tokens", "spec_num_draft_tokens",
         "Speculative decoding: draft tokens verified"),
        ("spec_decode_num_accepted_tokens", "spec_num_accepted_tokens",
         "Speculative decoding: draft tokens accepted"),
    )
    # (name, stats key holding {label value: total}, label, help)
    LABELLED_COUNTERS = (
        ("prefix_cache_hits_by_tier", "prefix_cache_hits_by_tier", "tier",
         "Prompt tokens found in the prefix cache, by the tier that held them (L1 device, "
         "L2 host memory, L3 file store)"),
        ("kv_transfer_bytes", "kv_transfer_bytes", "direction", "Bytes moved between KV tiers"),
        ("kv_transfer_seconds", "kv_transfer_seconds", "direction",
         "Seconds spent moving KV between tiers"),
        ("spec_decode_num_accepted_tokens_per_pos", "spec_accepted_per_position", "position",
         "Speculative decoding: draft tokens accepted, by position in the draft"),
    )

    def __init__(self, prefix: str, values: tuple[str, str], engine_stats: Callable[[], dict]) -> None:
        self.prefix, self.values, self.engine_stats = prefix, list(values), engine_stats

    def collect(self) -> Iterator[Metric]:
        stats = self.engine_stats()
        for name, key, doc in self.GAUGES:
            family = GaugeMetricFamily(self.prefix + name, doc, labels=LABELS)
            family.add_metric(self.values, float(stats.get(key, 0)))
            yield family
        for name, key, doc in self.COUNTERS:
            family = CounterMetricFamily(self.prefix + name, doc, labels=LABELS)
            family.add_metric(self.values, float(stats.get(key, 0)))
            yield family
        for name, key, label, doc in self.LABELLED_COUNTERS:
            family = CounterMetricFamily(self.prefix + name, doc, labels=[*LABELS, label])
            for value_label, value in (stats.get(key) or {}).items():
                family.add_metric([*self.values, value_label], float(value))
            yield family
        experts = stats.get("moe_expert_tokens")
        if experts:  # only with --moe-expert-stats
            family = CounterMetricFamily(
                self.prefix + "moe_expert_tokens", "Tokens routed to each expert of each MoE "
                "layer (--moe-expert-stats)", labels=[*LABELS, "layer", "expert"])
            for layer, counts in experts.items():
                for expert, count in enumerate(counts):
                    family.add_metric([*self.values, str(layer), str(expert)], float(count))
            yield family


class _InfoSeries(Collector):
    """An info series: facts as the labels of one gauge sample of value 1, as vLLM has
    ``cache_config_info``. ``skip_empty``: no sample while there are no facts."""

    def __init__(self, name: str, doc: str, values: tuple[str, str],
                 info: Callable[[], dict[str, str]], skip_empty: bool = False) -> None:
        self.name, self.doc, self.values, self.info = name, doc, values, info
        self.skip_empty = skip_empty

    def collect(self) -> Iterator[Metric]:
        info = self.info()
        family = GaugeMetricFamily(self.name, self.doc, labels=[*LABELS, *info])
        if info or not self.skip_empty:
            family.add_metric([*self.values, *info.values()], 1.0)
        yield family
