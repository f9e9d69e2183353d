"""Prefill/decode disaggregation through the real router and servers: a prefill instance,
a decode instance, the router orchestrating them; outputs equal colocated serving, KV
is freed on both sides, and a dead prefill instance costs no request."""

from __future__ import annotations

import contextlib
import json
import random
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from server_process import (
    ADMIN,
    MODEL,
    admin_workers,
    metrics,
    start_router,
    start_server,
    start_servers,
    stop,
)

from openinfer import LLM, SamplingParams
from openinfer.kv.block_hash import extend_block_hashes

MiB = 1024**2


def _metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith((name + " ", name + "{")):  # one series: this server's model
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in {base}/metrics")



@pytest.fixture(scope="module")
def servers(qwen3_checkpoint):
    """A prefill instance, a decode instance, and a decode instance that fails requests whose
    KV it cannot pull (test_fail_policy...): all three started at once."""
    started = start_servers(
        (qwen3_checkpoint, "--role", "prefill", "--kv-lease-timeout", "30"),
        (qwen3_checkpoint, "--role", "decode"),
        (qwen3_checkpoint, "--role", "decode", "--kv-load-failure-policy", "fail",
         "--kv-transfer-timeout", "1"))
    yield started
    for _, proc in started:
        stop(proc)


@pytest.fixture(scope="module")
def pd(servers, qwen3_checkpoint):
    (prefill, p_proc), (decode, d_proc), _ = servers
    router, r_proc = start_router([decode], qwen3_checkpoint, "--prefill", prefill,
                                  "--disagg-min-tokens", "32")
    yield {"prefill": prefill, "decode": decode, "router": router, "prefill_proc": p_proc,
           "decode_proc": d_proc}
    stop(r_proc)


def _complete(base: str, prompt, max_tokens: int = 8, **extra) -> httpx.Response:
    resp = httpx.post(f"{base}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, **extra})
    assert resp.status_code == 200, resp.text
    return resp


# First: it needs none of the module's servers (idle, but still running).
@pytest.mark.slow
def test_serve_disaggregate_starts_prefill_and_decode_behind_a_router(qwen3_checkpoint):
    base, proc = start_server(qwen3_checkpoint, "--disaggregate", "1:1", "--disagg-min-tokens",
                              "16")
    try:
        workers = admin_workers(base)
        assert sorted(w["role"] for w in workers) == ["prefill", "serve"]
        resp = _complete(base, list(range(10, 90)))
        prefill = next(w["url"] for w in workers if w["role"] == "prefill")
        assert resp.headers["x-openinfer-prefill"] == prefill
        assert resp.json()["usage"]["completion_tokens"] == 8
    finally:
        stop(proc)


@pytest.mark.slow
def test_a_decode_instance_with_kv_tiers_speculation_and_preemption(qwen3_checkpoint, tmp_path):
    """A decode instance with host memory, a file store and suffix speculative decoding, on
    a device pool of 15 blocks, behind the router: four pulled prompts at once (8 blocks each:
    preempted after their pulls) decode with drafts and give the offline tokens; one comes
    back from host memory (L2), and a prompt it computed, the cache reset, from the file
    store (L3)."""
    store = tmp_path / "store"
    spec = json.dumps({"method": "suffix", "num_speculative_tokens": 4})
    (prefill, p_proc), (decode, d_proc) = start_servers(
        (qwen3_checkpoint, "--role", "prefill", "--kv-lease-timeout", "30"),
        (qwen3_checkpoint, "--role", "decode", "--kv-cache-memory", str(15 * 8192),
         "--max-model-len", "160", "--kv-host-memory", "4MiB", "--kv-store-dir", str(store),
         "--speculative-config", spec))
    router, r_proc = start_router([decode], qwen3_checkpoint, "--prefill", prefill,
                                  "--disagg-min-tokens", "32")
    try:
        rng = random.Random(7)
        # Repeating segments: the suffix drafter finds continuations to propose.
        prompts = [[rng.randrange(3, 1000) for _ in range(20)] * 5 for _ in range(5)]
        offline = LLM(str(qwen3_checkpoint), kv_cache_memory=32 * MiB, progress=False)
        expected = [o.outputs[0].text for o in offline.generate(
            prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))]
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: _complete(router, p, max_tokens=24), prompts[:4]))
        assert [a.json()["choices"][0]["text"] for a in answers] == expected[:4]
        assert all(a.headers["x-openinfer-prefill"] == prefill for a in answers)
        assert _metric(decode, "openinfer:kv_remote_blocks_pulled_total") == 4 * 6
        # Pulled blocks are neither a hit nor computed here: the usage says so.
        assert [a.json()["usage"]["prompt_tokens_by_source"] for a in answers] == [
            {"L1": 0, "L2": 0, "L3": 0, "pulled": 96, "computed": 4}] * 4
        # (Decode-side preemption depends on the four pulls overlapping in time: a clean-clone
        # run saw none, so it is not asserted here; the tokens must match either way.)
        assert _metric(decode, "openinfer:spec_decode_num_draft_tokens_total") > 0
        # Sent again one by one, straight to it: 15 device blocks hold at most two prompts'
        # 6 full blocks, so the others' come back from host memory (L2).
        again = [_complete(decode, p, max_tokens=24) for p in prompts[:4]]
        assert [a.json()["choices"][0]["text"] for a in again] == expected[:4]
        assert all(a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
                   for a in again)
        assert metrics(decode)["openinfer:prefix_cache_hits_by_tier_total[L2]"] > 0
        sources = [a.json()["usage"]["prompt_tokens_by_source"] for a in again]
        assert all(s["L1"] + s["L2"] == 96 and s["computed"] == 4 for s in sources)
        assert sum(s["L2"] for s in sources) == metrics(decode)[
            "openinfer:prefix_cache_hits_by_tier_total[L2]"]
        # A prompt it computes itself reaches its file store; L1 and L2 forgotten, it comes
        # back from L3.
        assert _complete(decode, prompts[4], max_tokens=24).json()["choices"][0]["text"] == (
            expected[4])
        hashes: list[bytes] = []
        extend_block_hashes(hashes, prompts[4], 16, None)
        assert _poll(lambda: all(any(store.rglob(f"{h.hex()}*")) for h in hashes), True, 30)
        reset = httpx.post(f"{decode}/v1/cache/reset", headers=ADMIN, timeout=30)
        assert reset.status_code == 200, reset.text
        assert _complete(decode, prompts[4], max_tokens=24).json()["choices"][0]["text"] == (
            expected[4])
        assert metrics(decode)["openinfer:prefix_cache_hits_by_tier_total[L3]"] >= 6 * 16
        assert _poll(lambda: _metric(decode, "openinfer:kv_cache_usage_perc"), 0, 30)
        assert _poll(lambda: _metric(prefill, "openinfer:kv_leases"), 0, 30)
    finally:
        stop(r_proc)
        stop(d_proc)
        stop(p_proc)


@pytest.mark.slow
def test_disaggregated_serving_equals_colocated_and_frees_kv_on_both_sides(pd, servers,
                                                                          qwen3_checkpoint):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(100)] for _ in range(4)]
    offline = LLM(str(qwen3_checkpoint), kv_cache_memory=32 * MiB, progress=False)
    expected = [o.outputs[0].text for o in offline.generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
    for prompt, text in zip(prompts, expected):
        resp = _complete(pd["router"], prompt)
        assert resp.json()["choices"][0]["text"] == text
        assert resp.headers["x-openinfer-prefill"] == pd["prefill"]
        assert resp.headers["x-openinfer-worker"] == pd["decode"]
    # Streaming goes the same way.
    with httpx.stream("POST", f"{pd['router']}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompts[0][:50] + [7] * 50, "max_tokens": 8,
            "temperature": 0, "ignore_eos": True, "stream": True}) as stream:
        assert stream.headers["x-openinfer-prefill"] == pd["prefill"]
        chunks = [json.loads(line[5:]) for line in stream.iter_lines()
                  if line.startswith("data:") and "[DONE]" not in line]
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    # Compared with another instance, whose cache holds none of the pulled blocks.
    independent = servers[2][0]
    direct = _complete(independent, prompts[0][:50] + [7] * 50).json()["choices"][0]["text"]
    assert streamed == direct
    # Anthropic's endpoint disaggregates too.
    messages = {"model": MODEL, "max_tokens": 6, "temperature": 0,
                "messages": [{"role": "user", "content": "tell me a story " * 12}]}
    via_router = httpx.post(f"{pd['router']}/v1/messages", json=messages, timeout=120)
    assert via_router.status_code == 200, via_router.text
    assert via_router.headers["x-openinfer-prefill"] == pd["prefill"]
    direct = httpx.post(f"{independent}/v1/messages", json=messages, timeout=120).json()
    assert via_router.json()["content"] == direct["content"]
    # A short prompt, and a prompt whose prefix the decode instance now holds, skip prefill.
    assert _complete(pd["router"], "hello").headers["x-openinfer-prefill"] == "none"
    assert _complete(pd["router"], prompts[1]).headers["x-openinfer-prefill"] == "none"
    assert _metric(pd["decode"], "openinfer:kv_remote_blocks_pulled_total") >= 4 * 6
    assert _metric(pd["decode"], "openinfer:kv_remote_pull_failures_total") == 0
    assert _metric(pd["prefill"], "openinfer:kv_bytes_served_total") > 0
    for _ in range(50):  # the last pull's release reaches the prefill engine
        if _metric(pd["prefill"], "openinfer:kv_leases") == 0:
            break
        time.sleep(0.1)
    assert _metric(pd["prefill"], "openinfer:kv_leases") == 0
    assert _metric(pd["prefill"], "openinfer:kv_leases_expired_total") == 0  # each released
    assert _metric(pd["prefill"], "openinfer:kv_cache_usage_perc") == 0
    assert _metric(pd["decode"], "openinfer:kv_cache_usage_perc") == 0
    metrics = httpx.get(f"{pd['router']}/metrics", timeout=30).text
    assert 'openinfer_router:disagg_decisions_total{decision="prefill_then_decode"} 6.0' in metrics
    assert 'openinfer_router:disagg_decisions_total{decision="decode_only"} 2.0' in metrics


def _poll(read, want, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while read() != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return read() == want


@pytest.mark.slow
def test_a_decode_leg_that_never_starts_releases_the_prefill_lease(pd, qwen3_checkpoint):
    """The prefill instance holds a prompt's KV, and the decode leg never starts: no decode
    instance answers (a frozen one, ejected), or the client leaves first, between the legs
    or during the prefill leg. Each time the router releases the lease at once, instead of
    the prefill instance holding the blocks to its lease timeout (30 s here, long enough
    that a loaded CI machine never runs one out on its own; one that ran out would count
    as expired)."""
    prefill, decode = pd["prefill"], pd["decode"]
    router, r_proc = start_router([decode], qwen3_checkpoint, "--prefill", prefill,
                                  "--disagg-min-tokens", "32")
    frozen = pd["decode_proc"]
    prompt = list(range(200, 300))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    expired = _metric(prefill, "openinfer:kv_leases_expired_total")

    def released() -> float:
        return _metric(router, "openinfer_router:disagg_leases_released_total")

    def healthy(*routers: str) -> bool:
        return all(w["healthy"] for r in routers for w in admin_workers(r))

    try:
        # No decode instance answers: the one chosen is frozen, then ejected.
        frozen.send_signal(signal.SIGSTOP)
        resp = httpx.post(f"{router}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 503 and resp.headers.get("x-openinfer-prefill") is None
        assert _poll(released, 1, 10) and _poll(
            lambda: _metric(prefill, "openinfer:kv_leases"), 0, 2)
        frozen.send_signal(signal.SIGCONT)
        assert _poll(lambda: healthy(router), True, 30)
        # The client leaves once the prefill instance holds the KV, before decode answers.
        frozen.send_signal(signal.SIGSTOP)
        with _raw_request(router, {**body, "prompt": prompt[::-1]}):
            assert _poll(lambda: _metric(prefill, "openinfer:kv_leases"), 1, 60)
        assert _poll(released, 2, 10) and _poll(
            lambda: _metric(prefill, "openinfer:kv_leases"), 0, 2)
        frozen.send_signal(signal.SIGCONT)
        assert _poll(lambda: healthy(router), True, 30)
        # The client leaves during the prefill leg (the prefill engine stopped under it): the
        # leg runs to its end behind the router, which releases the lease it returns. (Cut
        # short, the leg would abort a prefill still running, but one just finished would
        # hold a lease nobody hears of, to its timeout.)
        engine = next(p for p in psutil.Process(pd["prefill_proc"].pid).children()
                      if any("spawn_main" in arg for arg in p.cmdline()))
        engine.suspend()
        try:
            with _raw_request(router, {**body, "prompt": prompt[50:] + prompt[:50]}):
                assert _poll(lambda: {w["url"]: w for w in admin_workers(router)}[prefill][
                    "in_flight"], 1, 30)
            left = 'openinfer_router:disagg_decisions_total{decision="client_left"} 1.0'
            assert _poll(lambda: left in httpx.get(f"{router}/metrics", timeout=30).text,
                         True, 10)
        finally:
            engine.resume()
        assert _poll(released, 3, 30) and _poll(
            lambda: _metric(prefill, "openinfer:kv_leases"), 0, 2)
        assert _metric(prefill, "openinfer:kv_leases_expired_total") == expired
    finally:
        frozen.send_signal(signal.SIGCONT)
        stop(r_proc)
    assert _poll(lambda: healthy(pd["router"]), True, 30)  # (the next tests' router)


@contextlib.contextmanager
def _raw_request(base: str, body: dict):
    """A completion request sent on a bare socket, whose client hangs up on leaving."""
    host, port = base.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
                       b"Content-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))
        yield


@pytest.mark.slow
def test_a_dead_prefill_instance_costs_no_request(pd, qwen3_checkpoint):
    rng = random.Random(1)
    prompt = [rng.randrange(3, 1000) for _ in range(80)]
    pd["prefill_proc"].kill()
    pd["prefill_proc"].wait()
    resp = _complete(pd["router"], prompt)  # the decode instance recomputes
    assert resp.headers["x-openinfer-prefill"] == "none"
    offline = LLM(str(qwen3_checkpoint), kv_cache_memory=32 * MiB, progress=False)
    assert resp.json()["choices"][0]["text"] == offline.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].text
    workers = {w["url"]: w for w in admin_workers(pd['router'])}
    assert workers[pd["prefill"]]["role"] == "prefill" and not workers[pd["prefill"]]["healthy"]
    metrics = httpx.get(f"{pd['router']}/metrics", timeout=30).text
    assert 'openinfer_router:disagg_decisions_total{decision="prefill_failed"} 1.0' in metrics
    assert _metric(pd["decode"], "openinfer:kv_cache_usage_perc") == 0


@pytest.mark.slow
def test_fail_policy_answers_503_and_an_error_event(servers):
    base = servers[2][0]  # --role decode --kv-load-failure-policy fail --kv-transfer-timeout 1
    prompt = list(range(20, 100))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt, 16, None)
    with socket.socket() as s:  # a port nobody listens on: the prefill instance is gone
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "kv_transfer_params": {"remote_host": "127.0.0.1", "remote_port": dead,
                                   "remote_lease_id": "gone",
                                   "remote_block_hashes": [h.hex() for h in hashes]}}
    resp = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "request_failed"
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True},
                      timeout=60) as stream:
        events = [json.loads(line[5:]) for line in stream.iter_lines()
                  if line.startswith("data:") and "[DONE]" not in line]
    assert events[-1]["error"]["code"] == "request_failed"
    ok = httpx.post(f"{base}/v1/completions", timeout=60, json={**body,
                                                                 "kv_transfer_params": None})
    assert ok.status_code == 200  # the engine serves on
    assert _metric(base, "openinfer:kv_remote_pull_failures_total") == 2
    assert _metric(base, "openinfer:kv_cache_usage_perc") == 0
