"""What the router reads from its replicas' Prometheus metrics: their load, and the series it
re-exports so that one scrape of the router sees the whole cluster.

Replicas name their series ``<prefix>:<name>`` (``openinfer``, ``vllm`` or any other prefix:
``serve --metrics-prefix``) and label them ``model_name`` and ``engine``. The router reads
load by the part of a name after its last ':', so any prefix works. Re-exported series keep
their names and labels except ``engine``, which the router sets to its own number for the
replica: unique within the router even when replicas were started by hand, each with the
default engine "0". ``serve --data-parallel-size`` gives each replica that same number
(``--metrics-engine-index``), so a replica's own /metrics and the router's agree.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterator

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)
SCRAPE_TIMEOUT_S = 2.0

# name, optional {labels}, value (a timestamp may follow).
_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{.*\})?\s+(\S+)")


def replica_load(text: str) -> tuple[int, float]:
    """(requests running + waiting, KV cache usage 0-1) from a replica's /metrics text,
    whatever its prefix and labels. Several samples of one gauge add up (usage: the highest);
    what is absent or unreadable counts 0."""
    requests, usage = 0.0, 0.0
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        base = match.group(1).rpartition(":")[2]
        if base not in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            continue
        try:
            value = float(match.group(2))
        except ValueError:
            continue
        if base == "kv_cache_usage_perc":
            usage = max(usage, value)
        else:
            requests += value
    return int(requests), usage


def merge_expositions(texts: dict[str, str]) -> list[Metric]:
    """Several replicas' /metrics texts as one set of metric families, each sample labelled
    ``engine`` with its replica's key in ``texts``. A family keeps the help and type of the
    first replica that has it; a replica whose text does not parse, or whose family has
    another type there, is left out (with a warning)."""
    families: dict[str, Metric] = {}
    for engine, text in texts.items():
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError as e:
            logger.warning("metrics of replica %s do not parse: %s", engine, e)
            continue
        for family in parsed:
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation,
                                                        family.type, family.unit)
            elif merged.type != family.type:
                logger.warning("replica %s: %s is a %s, not a %s", engine, family.name,
                               family.type, merged.type)
                continue
            merged.samples += [s._replace(labels={**s.labels, "engine": engine})
                               for s in family.samples]
    return list(families.values())


async def scrape_replicas(http: httpx.AsyncClient, replicas: dict[str, str]) -> dict[str, str]:
    """{engine: /metrics text} of ``replicas`` ({engine: base URL}), fetched concurrently;
    a replica that does not answer 200 within SCRAPE_TIMEOUT_S is left out."""
    async def fetch(url: str) -> str | None:
        try:
            resp = await http.get(f"{url}/metrics", timeout=SCRAPE_TIMEOUT_S)
        except (httpx.HTTPError, OSError):
            return None
        return resp.text if resp.status_code == 200 else None

    texts = await asyncio.gather(*(fetch(url) for url in replicas.values()))
    return {engine: text for engine, text in zip(replicas, texts) if text is not None}


async def cluster_exposition(http: httpx.AsyncClient, replicas: dict[str, str],
                             registry: CollectorRegistry) -> bytes:
    """The router's /metrics: its own series (``registry``), then every replica's
    (``replicas``: {engine: base URL}) labelled by ``engine``. A replica's family named as
    one of the router's is dropped (a family must appear once)."""
    own = {family.name for family in registry.collect()}
    families = [f for f in merge_expositions(await scrape_replicas(http, replicas))
                if f.name not in own]
    return generate_latest(registry) + generate_latest(_Families(families))


class _Families:
    """Ready-made metric families, as generate_latest wants them (a collect() method)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)
