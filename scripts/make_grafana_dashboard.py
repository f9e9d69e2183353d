"""Write docs/grafana/openinfer.json: a Grafana dashboard for openinfer's own series, the ones
vLLM's dashboard has no panels for (KV tiers and pins, disaggregation, speculation, the
router), beside the load and latency every server has. Import it in Grafana (Dashboards >
Import) over a Prometheus that scrapes the server or, for the whole cluster in one scrape,
the router. tests/e2e/test_grafana_dashboard.py checks that every query finds a series.

    python scripts/make_grafana_dashboard.py
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "openinfer.json"
P = "openinfer:"
R = "openinfer_router:"

def _quantiles(histogram: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le) (rate({P}{histogram}_bucket[5m])))", f"p{name}")
            for q, name in ((0.5, "50"), (0.99, "99"))]


ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    ("Load and throughput", [
        ("Requests", "short", [(f"sum by (engine) ({P}num_requests_running)", "running {{engine}}"),
                               (f"sum by (engine) ({P}num_requests_waiting)", "waiting {{engine}}"),
                               (f"sum by (engine) ({P}num_requests_loading)",
                                "loading from L3 / pulling {{engine}}")]),
        ("Tokens per second", "short", [
            (f"sum(rate({P}prompt_tokens_total[1m]))", "prompt"),
            (f"sum(rate({P}generation_tokens_total[1m]))", "generated")]),
        ("Time to first token", "s", _quantiles("time_to_first_token_seconds")),
        ("Inter-token latency", "s", _quantiles("inter_token_latency_seconds")),
    ]),
    ("KV cache and its tiers", [
        ("Prefix-cache hit rate", "percentunit", [
            (f"sum(rate({P}prefix_cache_hits_total[5m])) / sum(rate({P}prefix_cache_queries_total[5m]))",
             "hit rate")]),
        ("Prompt tokens found, by tier", "short", [
            (f"sum by (tier) (rate({P}prefix_cache_hits_by_tier_total[5m]))", "{{tier}}")]),
        ("Device KV in use", "percentunit", [(f"{P}kv_cache_usage_perc", "{{engine}}")]),
        ("Host tier (L2) blocks and file store (L3) bytes", "short", [
            (f"sum by (engine) ({P}kv_host_blocks_used)", "L2 blocks {{engine}}"),
            (f"sum by (engine) ({P}kv_store_bytes)", "L3 bytes {{engine}}")]),
        ("Bytes moved between tiers", "Bps", [
            (f"sum by (direction) (rate({P}kv_transfer_bytes_total[5m]))", "{{direction}}")]),
        ("Pinned blocks (prompt caching, tool-call retention)", "short", [
            (f"sum by (engine) ({P}kv_pinned_blocks)", "pinned {{engine}}"),
            (f"sum(rate({P}kv_pins_refused_total[5m]))", "pins refused /s")]),
        ("Store and offload trouble", "short", [
            (f"sum(rate({P}kv_store_read_failures_total[5m]))", "store files rejected /s"),
            (f"sum(rate({P}kv_store_write_failures_total[5m]))", "writes refused /s"),
            (f"sum(rate({P}kv_store_writes_skipped_total[5m]))", "writes skipped (disk lagged) /s"),
            (f"sum(rate({P}kv_host_stores_skipped_total[5m]))", "host offloads skipped /s"),
            (f"sum(rate({P}num_preemptions_total[5m]))", "preemptions /s")]),
    ]),
    ("Prefill/decode disaggregation", [
        ("Leases held by prefill instances", "short", [
            (f"sum by (engine) ({P}kv_leases)", "{{engine}}"),
            (f"sum(rate({P}kv_leases_expired_total[5m]))", "expired /s")]),
        ("KV pulled and served", "short", [
            (f"sum(rate({P}kv_remote_blocks_pulled_total[5m]))", "blocks pulled /s"),
            (f"sum(rate({P}kv_remote_pull_failures_total[5m]))", "pulls failed /s"),
            (f"sum(rate({P}kv_bytes_served_total[5m]))", "bytes served /s")]),
        ("Router: disaggregation per request", "short", [
            (f"sum by (decision) (rate({R}disagg_decisions_total[5m]))", "{{decision}}")]),
    ]),
    ("Speculative decoding", [
        ("Draft acceptance", "percentunit", [
            (f"sum(rate({P}spec_decode_num_accepted_tokens_total[5m])) / "
             f"sum(rate({P}spec_decode_num_draft_tokens_total[5m]))", "accepted / drafted")]),
        ("Accepted drafts by position", "short", [
            (f"sum by (position) (rate({P}spec_decode_num_accepted_tokens_per_pos_total[5m]))",
             "position {{position}}")]),
    ]),
    ("Router", [
        ("Decisions by reason", "short", [
            (f"sum by (reason) (rate({R}decisions_total[5m]))", "{{reason}}")]),
        ("Blocks the chosen replica held", "percentunit", [
            (f"rate({R}matched_blocks_total[5m]) / rate({R}prompt_blocks_total[5m])", "matched / prompt")]),
        ("Replicas: in flight and health", "short", [
            (f"{R}worker_in_flight", "in flight {{worker}}"),
            (f"{R}worker_healthy", "healthy {{worker}}"),
            (f"sum by (worker) (rate({R}rerouted_requests_total[5m]))", "rerouted {{worker}}")]),
    ]),
]


def dashboard() -> dict:
    panels, y, next_id = [], 0, 1
    for row, charts in ROWS:
        panels.append({"type": "row", "title": row, "id": next_id, "collapsed": False,
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})
        next_id, y = next_id + 1, y + 1
        for i, (title, unit, queries) in enumerate(charts):
            panels.append({
                "type": "timeseries", "title": title, "id": next_id,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"x": (i % 3) * 8, "y": y + (i // 3) * 8, "w": 8, "h": 8},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend,
                             "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                            for j, (expr, legend) in enumerate(queries)]})
            next_id += 1
        y += 8 * ((len(charts) + 2) // 3)
    return {"title": "openinfer", "uid": "openinfer", "schemaVersion": 39, "version": 1,
            "editable": True, "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
            "tags": ["openinfer"],
            "templating": {"list": [{"name": "datasource", "type": "datasource",
                                     "query": "prometheus", "label": "Prometheus"}]},
            "panels": panels}


if __name__ == "__main__":
    OUT.write_text(json.dumps(dashboard(), indent=1) + "\n")
    print("wrote", OUT)
