"""The benchmark's arithmetic: oracle prefix hits, latency definitions, economics."""

from __future__ import annotations

import pytest

from openinfer.bench.client import RequestResult
from openinfer.bench.metrics import Prices, economics, summarize
from openinfer.bench.runner import PrefixTrie


def test_prefix_trie_is_an_infinite_prefix_cache():
    trie = PrefixTrie()
    assert trie.match([1, 2, 3]) == 0
    trie.insert([1, 2, 3, 4])
    assert trie.match([1, 2, 3, 4, 5]) == 4
    assert trie.match([1, 2, 9]) == 2
    trie.insert([1, 2, 7, 8])  # splits the edge after [1, 2]
    assert trie.match([1, 2, 7, 8, 9]) == 4 and trie.match([1, 2, 3, 4]) == 4
    assert trie.match([2, 1]) == 0


def test_multi_turn_oracle_on_a_hand_checked_trace():
    """Two users, two turns each, as the runner feeds the trie: a prompt is held once sent,
    prompt + answer once answered; turn 2 resends turn 1's conversation."""
    trie = PrefixTrie()
    system = [100, 101, 102, 103]               # shared by both users
    a1 = system + [1, 1]                          # user A turn 1 (6 tokens): hits 0
    b1 = system + [2, 2, 2]                       # user B turn 1 (7 tokens): hits the system, 4
    hits = []
    for prompt in (a1, b1):
        hits.append(trie.match(prompt))
        trie.insert(prompt)
    trie.insert(a1 + [50, 51])                    # A's answer
    trie.insert(b1 + [60])                        # B's answer
    a2 = a1 + [50, 51] + [3]                      # 9 tokens, 8 cached
    b2 = b1 + [61] + [4, 4]                       # answer re-tokenized differently: 7 cached of 10
    for prompt in (a2, b2):
        hits.append(trie.match(prompt))
        trie.insert(prompt)
    assert hits == [0, 4, 8, 7]
    results = [RequestResult(0, 0, 0.0, ok=True, ttft_s=0.1, e2e_s=0.2, prompt_tokens=len(p),
                             output_tokens=2, expected_output_tokens=2, oracle_hit_tokens=h)
               for p, h in zip((a1, b1, a2, b2), hits)]
    summary = summarize(results, duration_s=1.0)
    assert summary["oracle_hit_rate"] == pytest.approx(19 / 32)


def test_latency_definitions_and_goodput():
    fast = RequestResult(0, 0, 0.0, ok=True, ttft_s=0.1, e2e_s=1.1, itl_s=[0.25] * 4,
                         output_tokens=5, expected_output_tokens=5, prompt_tokens=10)
    slow = RequestResult(1, 0, 0.0, ok=True, ttft_s=0.5, e2e_s=2.5, itl_s=[0.5] * 4,
                         output_tokens=5, expected_output_tokens=5, prompt_tokens=10)
    failed = RequestResult(2, 0, 0.0, error="HTTP 500: boom")
    assert fast.tpot_s == pytest.approx(0.25) and slow.tpot_s == pytest.approx(0.5)
    s = summarize([fast, slow, failed], duration_s=2.0, slo_ms={"ttft": 200, "tpot": 300})
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 500: boom"])
    assert s["goodput"] == pytest.approx(0.5)  # only `fast` meets both SLOs, over 2 s
    assert s["ttft_ms"]["mean"] == pytest.approx(300) and s["ttft_ms"]["p50"] == pytest.approx(300)
    assert s["itl_ms"]["p50"] == pytest.approx(375)
    assert s["output_token_throughput"] == pytest.approx(5.0) and s["output_tokens_exact"]


def test_economics_worked_example():
    """1 hour at 1,000 prompt tokens/s (90% cache hits) and 100 output tokens/s, priced
    $0.10 hit / $1.00 miss / $2.00 output per million, on 2 accelerators at $1.50/hour:
    revenue = 3.24M x 0.10 + 0.36M x 1.00 + 0.36M x 2.00 = $1.404 per hour."""
    summary = {"duration_s": 3600.0, "prompt_tokens": 3_600_000, "cached_tokens": 3_240_000,
               "output_tokens": 360_000}
    e = economics(summary, Prices(0.10, 1.00, 2.00), accelerator_hour_cost=1.50,
                  num_accelerators=2)
    assert e["revenue_per_hour"] == pytest.approx(1.404)
    assert e["revenue_per_accelerator_hour"] == pytest.approx(0.702)
    assert e["cost_per_hour"] == pytest.approx(3.0)
    assert e["margin"] == pytest.approx((1.404 - 3.0) / 1.404)
    assert e["cost_per_million_output_tokens"] == pytest.approx(3.0 / 0.36)
    assert e["cost_per_million_tokens"] == pytest.approx(3.0 / 3.96)
    # Without the hardware's price: revenue, and no cost or margin (no made-up default).
    unpriced = economics(summary, Prices(0.10, 1.00, 2.00), accelerator_hour_cost=None)
    assert unpriced["revenue_per_hour"] == pytest.approx(1.404)
    assert unpriced["accelerator_hour_cost"] is None
    assert all(unpriced[k] is None for k in ("cost_per_hour", "margin",
                                             "cost_per_million_output_tokens",
                                             "cost_per_million_tokens"))
