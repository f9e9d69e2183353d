"""Figures of a benchmark run, named and defined as vLLM's `bench serve` does:

* TTFT: send to first chunk with output.
* TPOT: (E2E - TTFT) / (output tokens - 1), per request.
* ITL: every gap between successive output chunks, over all requests.
* E2E: send to the end of the stream.
* Goodput: requests per second that met every SLO given.
* Input-cache hit rate: cached prompt tokens reported in ``usage`` / prompt tokens.
* Oracle hit rate: prompt tokens an infinite cache holding every earlier prompt and answer
  would have served / prompt tokens (None when the oracle could not be scored).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from openinfer.bench.client import RequestResult

PERCENTILES = (50, 90, 99)
DEFINITIONS = ("TPOT = (E2E - TTFT) / (output tokens - 1); ITL = gaps between streamed chunks "
               "(vLLM bench serve's definitions); times in ms.")


@dataclass(frozen=True)
class Prices:
    """USD per million tokens. Defaults: DeepSeek's public API list price (deepseek-chat,
    V3.2, late 2025): $0.028 input cache hit, $0.28 input cache miss, $0.42 output."""
    input_cache_hit: float = 0.028
    input_cache_miss: float = 0.28
    output: float = 0.42


def latency_stats(values: list[float]) -> dict[str, float | None]:
    """mean and percentiles, in milliseconds."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(values) * 1000.0
    return {"mean": float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def _sources(done: list[RequestResult]) -> dict[str, int] | None:
    """The prompts' tokens by source (KV tier, pulled, computed), summed; None unless every
    answer said (a server other than openinfer's does not)."""
    if not done or any(r.prompt_sources is None for r in done):
        return None
    total: dict[str, int] = {}
    for r in done:
        for source, tokens in r.prompt_sources.items():
            total[source] = total.get(source, 0) + tokens
    return total


def summarize(results: list[RequestResult], duration_s: float,
              slo_ms: dict[str, float] | None = None) -> dict:
    done = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.output_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    oracle = (None if any(r.oracle_hit_tokens is None for r in done)
              else sum(r.oracle_hit_tokens for r in done))
    good = [r for r in done if _meets(r, slo_ms or {})]
    return {
        "num_requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:10],
        "duration_s": duration_s,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "output_tokens_exact": all(r.output_tokens == r.expected_output_tokens for r in done),
        # A session's first turn: later ones resend answers, which a server may run as the
        # ids it generated (openinfer does), not as this client encodes their text.
        "prompt_tokens_agree": (None if any(r.sent_prompt_tokens is None for r in done)
                                else all(r.prompt_tokens == r.sent_prompt_tokens
                                         for r in done if r.turn == 0)),
        "cached_tokens": cached,
        "request_throughput": len(done) / duration_s,
        "input_token_throughput": prompt / duration_s,
        "output_token_throughput": output / duration_s,
        "total_token_throughput": (prompt + output) / duration_s,
        "goodput": len(good) / duration_s if slo_ms else None,
        "slo_ms": slo_ms or None,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "prompt_tokens_by_source": _sources(done),
        "oracle_hit_rate": None if oracle is None else oracle / prompt if prompt else 0.0,
        "ttft_ms": latency_stats([r.ttft_s for r in done]),
        # Sessions of several turns: a session's first turn (cold) vs those that come back.
        "ttft_first_turn_ms": latency_stats([r.ttft_s for r in done if r.turn == 0]),
        "ttft_returning_ms": latency_stats([r.ttft_s for r in done if r.turn > 0]),
        "tpot_ms": latency_stats([t for r in done if (t := r.tpot_s) is not None]),
        "itl_ms": latency_stats([gap for r in done for gap in r.itl_s]),
        "e2e_ms": latency_stats([r.e2e_s for r in done]),
        "definitions": DEFINITIONS,
    }


def _meets(r: RequestResult, slo_ms: dict[str, float]) -> bool:
    measured = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2e": r.e2e_s}
    for name, limit in slo_ms.items():
        value = measured[name]
        if value is not None and value * 1000.0 > limit:
            return False
    return True


def economics(summary: dict, prices: Prices, accelerator_hour_cost: float | None,
              num_accelerators: int = 1) -> dict:
    """What the measured throughput earns and costs per accelerator-hour at list prices.

    Revenue/hour = 3600 s x (hit tokens/s x hit price + miss tokens/s x miss price
    + output tokens/s x output price) / 1e6, over the whole deployment, then per accelerator.
    Cost, margin and cost per token need the hardware's price (None without it: no default
    price fits both a CPU box and a GPU node)."""
    seconds = summary["duration_s"]
    hit_rate = summary["cached_tokens"] / seconds
    miss_rate = (summary["prompt_tokens"] - summary["cached_tokens"]) / seconds
    output_rate = summary["output_tokens"] / seconds
    revenue = 3600 * (hit_rate * prices.input_cache_hit + miss_rate * prices.input_cache_miss
                      + output_rate * prices.output) / 1e6
    priced = {
        "prices_per_million": vars(prices),
        "accelerator_hour_cost": accelerator_hour_cost,
        "num_accelerators": num_accelerators,
        "revenue_per_hour": revenue,
        "revenue_per_accelerator_hour": revenue / num_accelerators,
    }
    if accelerator_hour_cost is None:
        return {**priced, "cost_per_hour": None, "margin": None,
                "cost_per_million_output_tokens": None, "cost_per_million_tokens": None}
    cost = accelerator_hour_cost * num_accelerators
    million_per_hour = lambda rate: rate * 3600 / 1e6
    return {
        **priced,
        "cost_per_hour": cost,
        "margin": (revenue - cost) / revenue if revenue else None,
        "cost_per_million_output_tokens": (cost / million_per_hour(output_rate)
                                           if output_rate else None),
        "cost_per_million_tokens": (cost / million_per_hour(hit_rate + miss_rate + output_rate)
                                    if output_rate else None),
    }
