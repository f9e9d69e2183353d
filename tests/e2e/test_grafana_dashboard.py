"""The Grafana dashboard openinfer ships (docs/grafana/openinfer.json, written by
scripts/make_grafana_dashboard.py): every query selects series that a real router over a real
server (host tier, file store, n-gram speculation) exposes in one scrape."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families
from server_process import MODEL, start_router, start_server, stop

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "openinfer.json"


def _generator():
    spec = importlib.util.spec_from_file_location("make", ROOT / "scripts" / "make_grafana_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_query_of_the_dashboard_finds_a_series(qwen3_checkpoint, tmp_path):
    shipped = json.loads(DASHBOARD.read_text())
    assert shipped == _generator().dashboard(), "run scripts/make_grafana_dashboard.py"
    queries = [t["expr"] for p in shipped["panels"] for t in p.get("targets", ())]
    wanted = {name for q in queries for name in re.findall(r"openinfer(?:_router)?:[a-zA-Z0-9_]+", q)}
    assert len(queries) >= 30 and len(wanted) >= 30

    base, server = start_server(qwen3_checkpoint, "--kv-host-memory", "8MiB",
                                "--kv-store-dir", str(tmp_path / "store"), "--speculative-config",
                                '{"method": "ngram", "num_speculative_tokens": 3}')
    router, router_proc = start_router([base], qwen3_checkpoint)
    try:
        client = openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0)
        client.completions.create(model=MODEL, prompt="one two one two one two", max_tokens=8,
                                  extra_body={"ignore_eos": True})
        text = httpx.get(f"{router}/metrics", timeout=30).text
    finally:
        stop(router_proc)
        stop(server)
    families = list(text_string_to_metric_families(text))
    exposed = {s.name for f in families for s in f.samples}
    # A labelled series no event has made yet (a reroute, a disaggregation decision) is
    # declared (HELP, TYPE) without samples.
    declared = {f.name + suffix for f in families if not f.samples
                for suffix in ("", "_total", "_bucket", "_sum", "_count")}
    assert sorted(wanted - exposed - declared) == []
    assert len(wanted & exposed) >= len(wanted) - 2
