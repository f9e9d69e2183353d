"""`--save-result vllm`: a run as the flat JSON that `vllm bench serve --save-result` writes.

One request rate is one object, with vLLM's key names, units and conventions, so scripts that
parse vLLM's result files read ours:

* setup: ``date`` (``%Y%m%d-%H%M%S``), ``endpoint_type`` = ``backend`` (``openai`` for
  ``/v1/completions``, ``openai-chat`` for ``/v1/chat/completions``), ``label`` (None),
  ``model_id``, ``tokenizer_id``, ``num_prompts`` (the requests sent: a multi-turn session
  stops at its first failure, so this can be fewer than planned; ``completed + failed ==
  num_prompts`` always), ``request_rate`` (a number or ``"inf"``), ``burstiness`` (1.0 for
  Poisson arrivals, inf for ``--arrival fixed``), ``max_concurrency``;
* totals: ``duration`` (s), ``completed``, ``failed``, ``total_input_tokens`` and
  ``total_output_tokens`` (of the completed requests, as the server's ``usage`` counts them),
  ``request_throughput``, ``request_goodput`` (None without ``--slo``), ``output_throughput``,
  ``total_token_throughput``, ``max_output_tokens_per_s`` (the busiest whole second, counting
  streamed chunks), ``max_concurrent_requests`` (the most completed requests in flight at once);
* per request, in send order, failures included: ``input_lens``, ``output_lens`` (0 when
  failed), ``ttfts``, ``latencies`` (0.0 when failed), ``itls`` (lists), ``start_times``,
  ``generated_texts``, ``errors`` ("" when it succeeded); times in seconds. vLLM keeps these
  only with ``--save-detailed``; here they are always written;
* ``mean_``/``median_``/``std_``/``p{50,90,99}_`` of ``ttft_ms``, ``tpot_ms``, ``itl_ms`` and
  ``e2el_ms`` over the completed requests, in milliseconds, 0 when nothing was measured.
  TPOT and ITL are defined as in :mod:`openinfer.bench.metrics` (vLLM's definitions).
"""

from __future__ import annotations

import math

import numpy as np

from openinfer.bench.client import RequestResult
from openinfer.bench.metrics import PERCENTILES

BACKENDS = {"completions": "openai", "chat": "openai-chat"}
"""vLLM's backend name for each endpoint a workload uses."""


def vllm_result(results: list[RequestResult], duration_s: float, *, endpoint: str, model_id: str,
                tokenizer_id: str, request_rate: float, arrival: str, max_concurrency: int | None,
                goodput: float | None, date: str) -> dict:
    """The vLLM-format object of one run (see the module docstring for every key)."""
    done = [r for r in results if r.ok]
    input_lens = [r.prompt_tokens or r.sent_prompt_tokens or 0 for r in results]
    output_lens = [r.output_tokens if r.ok else 0 for r in results]
    total_input = sum(n for n, r in zip(input_lens, results) if r.ok)
    total_output = sum(output_lens)
    peak_tokens, peak_requests = _peaks(done)
    backend = BACKENDS[endpoint]
    result = {
        "date": date,
        "endpoint_type": backend,
        "backend": backend,
        "label": None,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": len(results),
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "burstiness": 1.0 if arrival == "poisson" else math.inf,
        "max_concurrency": max_concurrency,
        "duration": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": goodput,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "input_lens": input_lens,
        "output_lens": output_lens,
        "ttfts": [r.ttft_s if r.ok else 0.0 for r in results],
        "itls": [list(r.itl_s) if r.ok else [] for r in results],
        "latencies": [r.e2e_s if r.ok else 0.0 for r in results],
        "start_times": [r.start_s for r in results],
        "generated_texts": [r.text if r.ok else "" for r in results],
        "errors": [r.error or "" for r in results],
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
    }
    values = {"ttft": [r.ttft_s for r in done],
              "tpot": [t for r in done if (t := r.tpot_s) is not None],
              "itl": [gap for r in done for gap in r.itl_s],
              "e2el": [r.e2e_s for r in done]}
    for name, seconds in values.items():
        ms = np.asarray(seconds or [0.0]) * 1000.0
        result[f"mean_{name}_ms"] = float(ms.mean())
        result[f"median_{name}_ms"] = float(np.median(ms))
        result[f"std_{name}_ms"] = float(ms.std())
        for p in PERCENTILES:
            result[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    return result


def vllm_file_name(run: dict) -> str:
    """vLLM's default result file name for a run made by :func:`vllm_result`:
    ``{backend}-{rate}qps[-concurrency{N}]-{last part of the model id}-{date}.json``."""
    concurrency = (f"-concurrency{run['max_concurrency']}" if run["max_concurrency"] is not None
                   else "")
    return (f"{run['backend']}-{float(run['request_rate'])}qps{concurrency}-"
            f"{run['model_id'].split('/')[-1]}-{run['date']}.json")


def _peaks(done: list[RequestResult]) -> tuple[float, int]:
    """(most output chunks streamed in one whole second from the first send, most requests in
    flight at once), over completed requests; intervals are [send, end)."""
    if not done:
        return 0.0, 0
    t0 = min(r.start_s for r in done)
    per_second: dict[int, int] = {}
    events = []
    for r in done:
        t = r.start_s + r.ttft_s
        for gap in [0.0, *r.itl_s]:
            t += gap
            per_second[int(t - t0)] = per_second.get(int(t - t0), 0) + 1
        events += [(r.start_s, 1), (r.start_s + r.e2e_s, -1)]
    in_flight = peak = 0
    for _, delta in sorted(events):  # an end sorts before a start at the same time
        in_flight += delta
        peak = max(peak, in_flight)
    return float(max(per_second.values())), peak
