"""The router in front of three real replicas on loopback: every policy, cache affinity
from KV events, and a replica that dies and comes back."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import (
    ADMIN,
    MODEL,
    admin_workers,
    metrics,
    start_router,
    start_routers,
    start_server,
    start_servers,
    stop,
)

REPLICA_FLAGS = ("--kv-events-endpoint", "tcp://127.0.0.1:*",
                 "--kv-events-replay-endpoint", "tcp://127.0.0.1:*")
"""KV events on free ports: the router finds them on the replica's GET /kv_events."""


def _replica(checkpoint, port: int | None = None):
    return start_server(checkpoint, *REPLICA_FLAGS, port=port)


@pytest.fixture(scope="module")
def replica_procs(qwen3_checkpoint):
    """[url, process] of three replicas started at once; a test that replaces a process
    (test_a_replica_killed...) puts the new one here, so it is the one stopped at the end."""
    started = [list(r) for r in start_servers(*[(qwen3_checkpoint, *REPLICA_FLAGS)] * 3)]
    yield started
    for _, proc in started:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def replicas(replica_procs):
    return [base for base, _ in replica_procs]


ROUTER_FLAGS = {
    "round_robin": ("--policy", "round_robin"),
    "least_load": ("--policy", "least_load"),
    "power_of_two": ("--policy", "power_of_two"),
    "cache_aware": ("--policy", "cache_aware"),
    # --balance-rel 1.0 leaves --balance-abs as the bound (test_cache_aware_load_guard...)
    "load_guard": ("--policy", "cache_aware", "--balance-abs", "2", "--balance-rel", "1.0"),
}


@pytest.fixture(scope="module")
def router_procs(replicas, qwen3_checkpoint):
    """A router per entry of ROUTER_FLAGS over the three replicas, all started at once
    ((url, process) by name); a router keeps no state a later test relies on being fresh
    (each test counts its own requests, and in-flight counts are back at 0 after each)."""
    started = start_routers(replicas, qwen3_checkpoint, *ROUTER_FLAGS.values())
    yield dict(zip(ROUTER_FLAGS, started))
    for _, proc in started:
        stop(proc)


@pytest.fixture(scope="module")
def routers(router_procs):
    return {name: base for name, (base, _) in router_procs.items()}


def _complete(base: str, prompt, max_tokens: int = 6, **extra) -> tuple[str, str, str]:
    """(text, replica that served it, routing reason)."""
    resp = httpx.post(f"{base}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, **extra})
    assert resp.status_code == 200, resp.text
    return (resp.json()["choices"][0]["text"], resp.headers.get("x-openinfer-worker"),
            resp.headers.get("x-openinfer-route"))


def _chat(base: str, messages: list[dict]) -> tuple[str, str, str]:
    resp = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": messages, "max_tokens": 5, "temperature": 0,
        "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return (resp.json()["choices"][0]["message"]["content"],
            resp.headers.get("x-openinfer-worker"), resp.headers.get("x-openinfer-route"))


PROMPTS = [f"request number {i} says hello" for i in range(6)] + [list(range(7, 60))]


@contextlib.contextmanager
def _stream_on(client: httpx.Client, router: str, replica: str, body: dict):
    """A completions stream through a round-robin ``router`` that landed on ``replica`` (one
    of the next few does; those that land elsewhere are closed at once)."""
    for _ in range(6):
        stream = client.stream("POST", f"{router}/v1/completions", json=body)
        resp = stream.__enter__()
        if resp.headers["x-openinfer-worker"] == replica:
            break
        stream.__exit__(None, None, None)
    else:
        pytest.fail(f"no stream reached {replica}")
    try:
        yield resp
    finally:
        stream.__exit__(None, None, None)


# First: it needs none of the module's replicas and routers (idle, but still running).
@pytest.mark.slow
def test_serve_data_parallel_starts_replicas_behind_a_router(qwen3_checkpoint):
    base, proc = start_server(qwen3_checkpoint, "--data-parallel-size", "2",
                              "--metrics-prefix", "vllm")
    try:
        workers = admin_workers(base)
        assert len(workers) == 2 and all(w["healthy"] for w in workers)
        text, worker, _ = _complete(base, PROMPTS[0])
        assert worker in {w["url"] for w in workers}
        from openinfer import LLM, SamplingParams
        offline = LLM(str(qwen3_checkpoint), progress=False).generate(
            PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        assert text == offline[0].outputs[0].text
        _check_cluster_metrics(base, [w["url"] for w in workers])
    finally:
        stop(proc)
    assert proc.returncode in (0, -signal.SIGTERM)  # a graceful exit, within 30 s
    for w in workers:  # the replicas went with it
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{w['url']}/health", timeout=5)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["round_robin", "least_load", "power_of_two", "cache_aware"])
def test_every_policy_serves_what_a_single_server_serves(replicas, routers, policy):
    expected = [_complete(replicas[0], p)[0] for p in PROMPTS]
    router = routers[policy]
    served = [_complete(router, p) for p in PROMPTS]
    assert [text for text, _, _ in served] == expected
    assert {worker for _, worker, _ in served} <= set(replicas)
    if policy == "round_robin":
        assert {worker for _, worker, _ in served} == set(replicas)
    with httpx.stream("POST", f"{router}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "stream": True}) as stream:
        assert stream.status_code == 200
        text = "".join(json.loads(line[5:])["choices"][0]["text"]
                       for line in stream.iter_lines()
                       if line.startswith("data:") and "[DONE]" not in line)
    assert text == expected[0]
    models = httpx.get(f"{router}/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == MODEL


def _cache_hits(router: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{router}/metrics", timeout=30).text):
        for sample in family.samples:
            if (sample.name == "openinfer_router:decisions_total"
                    and sample.labels.get("reason") == "cache_hit"):
                return sample.value
    return 0.0


@pytest.mark.slow
def test_cache_aware_keeps_each_conversation_on_the_replica_holding_it(routers):
    router = routers["cache_aware"]
    hits_before = _cache_hits(router)  # the router may have served another test already
    homes: dict[int, str] = {}
    histories: dict[int, list[dict]] = {}
    # New conversations (no cached prefix) go to the replica routed the fewest requests so
    # far, which after the module's other tests may be one replica several times over:
    # conversations start until they live on two replicas at least.
    for user in range(16):
        histories[user] = [{"role": "system", "content": f"You are assistant {user}. " * 8},
                           {"role": "user", "content": "This is turn 0."}]
        indexed = _indexed_blocks(router)
        text, homes[user], _ = _chat(router, histories[user])
        histories[user].append({"role": "assistant", "content": text})
        _wait_indexed(router, homes[user], indexed)  # before its next turn is routed
        if user >= 3 and len(set(homes.values())) >= 2:
            break
    assert len(set(homes.values())) >= 2
    for turn in (1, 2):
        for user, history in histories.items():
            history.append({"role": "user", "content": f"This is turn {turn}."})
            text, worker, reason = _chat(router, history)
            history.append({"role": "assistant", "content": text})
            assert worker == homes[user], (user, turn)
            assert reason == "cache_hit"
    workers = admin_workers(router)
    assert all(w["events"] for w in workers) and sum(w["indexed_blocks"] for w in workers) > 0
    assert _cache_hits(router) - hits_before >= 2 * len(homes)  # turns 1 and 2 of each


def _indexed_blocks(router: str) -> dict[str, int]:
    return {w["url"]: w["indexed_blocks"] for w in admin_workers(router)}


def _wait_indexed(router: str, worker: str, before: dict[str, int], grew_by: int = 1) -> None:
    """Until the router's index of ``worker`` holds the blocks a request stored there (its
    KV events arrived; a subscription that missed them replays them at the next batch)."""
    deadline = time.monotonic() + 30
    while _indexed_blocks(router)[worker] < before[worker] + grew_by:
        assert time.monotonic() < deadline, "the replica's KV events never reached the router"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_session_stays_on_its_replica(routers):
    """Session affinity (x-session-id, or the body's `prompt_cache_key` or `user`): each next
    request of a session goes where its first went, though its prompt shares nothing cached
    there."""
    router = routers["cache_aware"]
    for s, how in enumerate(("header", "user", "prompt_cache_key", "header")):
        session = f"session-{s}-{time.monotonic_ns()}"
        served = []
        for turn in range(4):
            extra = {how: session} if how != "header" else {}
            resp = httpx.post(f"{router}/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": f"unrelated question {turn} of {session}",
                "max_tokens": 2, **extra},
                headers={"x-session-id": session} if how == "header" else {})
            assert resp.status_code == 200, resp.text
            served.append((resp.headers["x-openinfer-worker"],
                           resp.headers["x-openinfer-route"]))
        assert len({worker for worker, _ in served}) == 1, served
        assert [route for _, route in served[1:]] == ["affinity"] * 3, served


@pytest.mark.slow
def test_cache_aware_load_guard_holds_under_concurrent_load(routers):
    """Every request shares a prefix one replica holds, so affinity alone would send all of
    them there; under 24 concurrent requests the guard must spread them, and no request may
    go to a replica more than --balance-abs requests above the least loaded. (The guard
    acts when max - min > abs *and* max > rel * min; rel 1.0 leaves abs as the bound.)"""
    router = routers["load_guard"]  # --balance-abs 2 --balance-rel 1.0
    shared = list(range(100, 164))  # 4 full blocks
    indexed = _indexed_blocks(router)
    _, home, _ = _complete(router, shared + [1])
    _wait_indexed(router, home, indexed, grew_by=4)
    with ThreadPoolExecutor(24) as pool:
        served = list(pool.map(lambda i: _complete(router, shared + [2, i], max_tokens=12),
                               range(24)))
    reasons = {reason for _, _, reason in served}
    assert {"cache_hit", "load_override"} <= reasons, reasons
    assert len({worker for _, worker, _ in served}) >= 2
    metrics = httpx.get(f"{router}/metrics", timeout=30).text
    excess = next(float(line.split()[1]) for line in metrics.splitlines()
                  if line.startswith("openinfer_router:max_load_excess "))
    assert excess <= 2, excess


@pytest.mark.slow
def test_a_drained_replica_finishes_its_streams_and_gets_no_new_traffic(replicas, routers):
    """POST /admin/workers/drain: the replica gets no new request, the stream it is serving
    runs to its end, and the call returns once nothing is in flight there (the moment to
    restart it); undrain puts it back in rotation."""
    router, victim = routers["round_robin"], replicas[2]
    # 64 x 240 tokens: seconds on 2 cores (one sequence alone would end before the checks; a
    # machine that ends them first still passes: see the read order below)
    body = {"model": MODEL, "prompt": "a long story", "n": 64, "max_tokens": 240,
            "temperature": 1, "seed": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as client, _stream_on(client, router, victim, body) as resp:
        with ThreadPoolExecutor(1) as pool:
            # (hang guards only: on a 2-core box under load the stream took over 100 s)
            drained = pool.submit(httpx.post, f"{router}/admin/workers/drain", timeout=600,
                                  headers=ADMIN, json={"url": victim, "timeout_s": 500})
            deadline = time.monotonic() + 30
            while not {w["url"]: w for w in admin_workers(router)}[victim]["draining"]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            served = {_complete(router, p)[1] for p in PROMPTS[:6]}
            assert victim not in served and len(served) == 2
            # The drain has not returned while the stream is in flight there. Read in this
            # order (a drain that has returned sees no request come back), it cannot fail on a
            # machine fast enough to end 64 x 240 tokens first, as `not done()` alone could.
            returned = drained.done()
            in_flight = {w["url"]: w for w in admin_workers(router)}[victim]["in_flight"]
            assert not returned or in_flight == 0, in_flight
            events = [json.loads(line[6:]) for line in resp.iter_lines()
                      if line.startswith("data: {")]
            assert not any("error" in event for event in events)
            finished = [c["finish_reason"] for e in events for c in e["choices"]
                        if c["finish_reason"]]
            assert finished == ["length"] * 64  # all of it
            answer = drained.result()
        assert answer.status_code == 200 and answer.json()["drained"] is True
    undrained = httpx.post(f"{router}/admin/workers/undrain", headers=ADMIN, timeout=30,
                           json={"url": victim})
    assert undrained.status_code == 200
    assert victim in {_complete(router, p)[1] for p in PROMPTS[:6]}


def _rerouted(router: str, worker: str) -> float:
    family = _families(router).get("openinfer_router:rerouted_requests")
    return sum(s.value for s in family.samples if s.name.endswith("_total")
               and s.labels["worker"] == worker) if family else 0.0


@pytest.mark.slow
def test_a_replica_that_stops_answering_is_ejected_and_loses_no_request(replica_procs, routers):
    """A replica process frozen (SIGSTOP: the kernel still accepts its connections, nothing
    answers): the requests sent to it go to the others once the health loop ejects it, all
    answered as a replica answers them alone; thawed, it is re-admitted."""
    router = routers["round_robin"]
    (first, _), _, (url, frozen) = replica_procs
    expected = [_complete(first, p)[0] for p in PROMPTS[:6]]
    rerouted = _rerouted(router, url)
    frozen.send_signal(signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(6) as pool:  # round robin: some go to the frozen one first
            done = list(pool.map(lambda p: _complete(router, p), PROMPTS[:6] * 2))
        assert [text for text, _, _ in done] == expected * 2
        assert url not in {worker for _, worker, _ in done}
        assert _rerouted(router, url) > rerouted
        workers = {w["url"]: w for w in admin_workers(router)}
        assert not workers[url]["healthy"] and workers[url]["in_flight"] == 0
    finally:
        frozen.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 30
    while not {w["url"]: w for w in admin_workers(router)}[url]["healthy"]:
        assert time.monotonic() < deadline, "the thawed replica was not re-admitted"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_replica_that_answers_503_sends_the_request_elsewhere(replicas, qwen3_checkpoint):
    """A 503 from a replica (its engine dead or restarting, its queue full) starts nothing:
    the router tries the next replica, and when every replica refused, the client gets the
    last refusal itself (its code and Retry-After), not a relayed 503 while another replica
    had room. Here the queue is full: --max-num-seqs 1 --max-waiting-requests 0 and two
    requests admitted while its engine is stopped (/health still answers)."""
    (full, full_proc), = start_servers((qwen3_checkpoint, "--max-num-seqs", "1",
                                        "--max-waiting-requests", "0"))
    engine = next(p for p in psutil.Process(full_proc.pid).children()
                  if any("spawn_main" in arg for arg in p.cmdline()))
    router, router_proc = start_router([replicas[0], full], qwen3_checkpoint,
                                       "--policy", "round_robin")
    engine.suspend()
    try:
        with ThreadPoolExecutor(6) as pool:
            held = []
            try:
                _fill_queue(full, pool, held)
                _refused_elsewhere(router, full, replicas[0])
            finally:
                engine.resume()  # (before the pool waits on the held requests)
            statuses = [f.result().status_code for f in held]
            assert statuses.count(200) >= 2 and set(statuses) <= {200, 503}
        workers = admin_workers(router)
        assert [w["in_flight"] for w in workers] == [0]  # a refusal is not left counted
    finally:
        engine.resume()
        stop(router_proc)
        stop(full_proc)


def _fill_queue(full: str, pool: ThreadPoolExecutor, held: list) -> None:
    """Requests held by the stopped engine until a probe is refused: two admitted (one
    running, one waiting) is a full queue. A probe that overtook them is admitted instead,
    until its client gives up; a held one refused in its place answers 503 at once."""
    for i in range(6):
        held.append(pool.submit(httpx.post, f"{full}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": f"held {i}", "max_tokens": 2}))
        with contextlib.suppress(httpx.ReadTimeout):
            probe = httpx.post(f"{full}/v1/completions", timeout=2, json={
                "model": MODEL, "prompt": "hi", "max_tokens": 2})
            if probe.status_code == 503:
                return
    pytest.fail("the replica never refused a request")


def _refused_elsewhere(router: str, full: str, other: str) -> None:
    before = _rerouted(router, full)
    served = [_complete(router, p) for p in PROMPTS[:4]]  # round robin: 2 tried on full
    assert {worker for _, worker, _ in served} == {other}
    assert _rerouted(router, full) >= before + 2
    assert [text for text, _, _ in served] == [_complete(other, p)[0] for p in PROMPTS[:4]]
    removed = httpx.delete(f"{router}/admin/workers", params={"url": other}, headers=ADMIN,
                           timeout=30)
    assert removed.status_code == 200
    alone = httpx.post(f"{router}/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert alone.status_code == 503 and alone.headers["retry-after"]
    assert alone.json()["error"]["code"] == "overloaded"  # the replica's own answer
    assert alone.headers["x-openinfer-worker"] == full


def test_workers_added_at_run_time_enter_rotation_once_healthy(routers):
    """POST /admin/workers: a URL that is not a replica's is a 400; one where nothing
    answers is listed but never routed to; DELETE /admin/workers removes it."""
    router = routers["round_robin"]
    for bad in ({}, {"url": 7}, {"url": "not a url"}, {"url": "ftp://host:1"},
                {"url": "http://host"}):
        refused = httpx.post(f"{router}/admin/workers", headers=ADMIN, json=bad, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "url", bad
    with socket.socket() as nobody:
        nobody.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        url = f"http://127.0.0.1:{nobody.getsockname()[1]}"
        added = httpx.post(f"{router}/admin/workers", headers=ADMIN, json={"url": url},
                           timeout=30)
        assert added.status_code == 200
        try:
            assert url not in {_complete(router, p)[1] for p in PROMPTS[:6]}
            listed = {w["url"]: w for w in admin_workers(router)}
            assert not listed[url]["healthy"] and listed[url]["routed"] == 0
            assert _rerouted(router, url) == 0
        finally:
            removed = httpx.delete(f"{router}/admin/workers", params={"url": url},
                                   headers=ADMIN, timeout=30)
    assert removed.status_code == 200
    assert url not in {w["url"] for w in admin_workers(router)}


@pytest.mark.slow
def test_a_client_that_hangs_up_ends_the_request_on_the_replica(replicas, routers):
    """The replica sees the router's connection go with the client's: the request is
    aborted there (128 x 480 tokens would otherwise run on for seconds)."""
    body = {"model": MODEL, "prompt": "nobody reads this", "n": 128, "max_tokens": 480,
            "temperature": 1, "seed": 1, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as client, client.stream(
            "POST", f"{routers['round_robin']}/v1/completions", json=body) as resp:
        replica = resp.headers["x-openinfer-worker"]
        before = metrics(replica)
        assert next(resp.iter_lines()).startswith("data: {")
    deadline = time.monotonic() + 30
    while (now := metrics(replica))["openinfer:num_requests_running"] > 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ended = {reason: now.get(f"openinfer:request_success_total[{reason}]", 0)
             - before.get(f"openinfer:request_success_total[{reason}]", 0)
             for reason in ("abort", "length")}
    assert ended == {"abort": 1, "length": 0}


@pytest.mark.slow
def test_a_client_gone_before_a_non_streamed_answer_frees_the_replica(replicas, routers):
    """A non-streamed answer has no byte before its end: a client that gives up first (its
    read timeout) is seen by the router, which closes its connection to the replica, which
    aborts the request, instead of 128 x 480 tokens being made for nobody."""
    router = routers["round_robin"]
    before = {url: metrics(url) for url in replicas}
    body = {"model": MODEL, "prompt": "nobody waits for this", "n": 128, "max_tokens": 480,
            "temperature": 1, "seed": 1, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{router}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))

    def ended(reason: str) -> float:
        key = f"openinfer:request_success_total[{reason}]"
        return sum(metrics(url).get(key, 0) - before[url].get(key, 0) for url in replicas)

    deadline = time.monotonic() + 30
    while ended("abort") < 1 or any(metrics(url)["openinfer:num_requests_running"]
                                    for url in replicas):
        assert time.monotonic() < deadline, "the replica went on generating"
        time.sleep(0.05)
    assert (ended("abort"), ended("length")) == (1, 0)
    in_flight = metrics(router)
    assert all(in_flight[f"openinfer_router:worker_in_flight[{url}]"] == 0 for url in replicas)
    assert _complete(router, "still serving", max_tokens=2)[0]


def test_streams_ended_either_way_leave_no_connection_open_and_break_none(replicas,
                                                                        router_procs):
    """Each hang-up closes the router's connection to the replica. (A cancelled reader used to
    leave it open and pooled for good: one socket leaked per aborted stream, found by the
    soak against --data-parallel-size 2: 29 -> 926 open files over 950 aborts.) And a stream
    read to its end leaves its pooled connection alone: the next request on it is answered
    by that replica, not rerouted (shutting such a connection down ejected replicas)."""
    base, proc = router_procs["round_robin"]

    def open_files() -> int:
        return len(os.listdir(f"/proc/{proc.pid}/fd"))

    body = {"model": MODEL, "prompt": "hang up on me", "max_tokens": 8, "ignore_eos": True,
            "stream": True}
    rerouted = sum(_rerouted(base, url) for url in replicas)

    def read_to_the_end(client: httpx.Client) -> None:
        for _ in range(4):  # streams read to the end, among requests that reuse connections
            with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
                assert resp.read().endswith(b"data: [DONE]\n\n")
            assert client.post(f"{base}/v1/completions",
                               json={**body, "stream": False}).status_code == 200

    with httpx.Client(timeout=60) as client:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(read_to_the_end, [client] * 8))
        before = open_files()
        for _ in range(30):
            with client.stream("POST", f"{base}/v1/completions",
                               json={**body, "max_tokens": 64}) as resp:
                assert next(resp.iter_lines()).startswith("data: {")
    deadline = time.monotonic() + 15
    while open_files() > before + 6 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert open_files() <= before + 6, (before, open_files())
    assert sum(_rerouted(base, url) for url in replicas) == rerouted


@pytest.mark.slow
def test_a_rolling_restart_under_load_loses_no_request(replica_procs, routers,
                                                       qwen3_checkpoint):
    """Two replicas in turn drained, stopped (SIGTERM), started again on their address (an
    empty cache) and undrained, while 4 clients keep sending: every request is answered as
    a lone replica answers it, and none had to be rerouted (none was sent to a replica that
    was going away). The restarted replicas serve again."""
    router = routers["least_load"]
    prompts = [f"rolling restart request {i}" for i in range(8)]
    expected = {p: _complete(replica_procs[1][0], p)[0] for p in prompts}
    rerouted = sum(_rerouted(router, url) for url, _ in replica_procs)
    done = threading.Event()
    answers: list[tuple[str, str, str]] = []  # (prompt, text, replica)

    def client(k: int) -> None:
        for i in itertools.count(k):
            if done.is_set():
                return
            text, worker, _ = _complete(router, prompts[i % len(prompts)])
            answers.append((prompts[i % len(prompts)], text, worker))

    restarted = []
    with ThreadPoolExecutor(4) as pool:
        clients = [pool.submit(client, k) for k in range(4)]
        try:
            for slot in (0, 2):
                url, proc = replica_procs[slot]
                drained = httpx.post(f"{router}/admin/workers/drain", headers=ADMIN,
                                     timeout=90, json={"url": url, "timeout_s": 60})
                assert drained.status_code == 200 and drained.json()["drained"] is True
                stop(proc)
                assert proc.returncode in (0, -signal.SIGTERM)  # a graceful exit, within 30 s
                replica_procs[slot] = list(_replica(qwen3_checkpoint,
                                                    port=int(url.rsplit(":", 1)[1])))
                restarted.append(len(answers))
                assert httpx.post(f"{router}/admin/workers/undrain", headers=ADMIN, timeout=30,
                                  json={"url": url}).status_code == 200
                deadline = time.monotonic() + 30
                while not {w["url"]: w for w in admin_workers(router)}[url]["healthy"]:
                    assert time.monotonic() < deadline, "the restarted replica was not re-admitted"
                    time.sleep(0.1)
        finally:
            done.set()
            for future in clients:
                future.result()  # (a failed request fails here)
    assert len(answers) > restarted[-1] and all(text == expected[p] for p, text, _ in answers)
    assert sum(_rerouted(router, url) for url, _ in replica_procs) == rerouted
    back = {replica_procs[0][0], replica_procs[2][0]}
    assert back & {worker for _, _, worker in answers[restarted[0]:]}  # serving again


def test_a_replica_killed_under_load_loses_no_request_and_comes_back(replica_procs, routers,
                                                                    qwen3_checkpoint):
    prompts = [f"load request {i} asks for a story" for i in range(36)]
    expected = [_complete(replica_procs[0][0], p)[0] for p in prompts]
    router = routers["least_load"]
    victim_url, victim = replica_procs[1]
    # A stream on the victim when it dies: it ends with an error event after a prefix of
    # its text, never a token twice (the router never restarts a started response).
    story = {"model": MODEL, "prompt": "a story cut short", "max_tokens": 480,
             "temperature": 0, "ignore_eos": True}
    whole = _complete(replica_procs[0][0], story["prompt"], max_tokens=480)[0]
    rerouted = _rerouted(router, victim_url)
    done = []
    with httpx.Client(timeout=120) as client, _stream_on(
            client, routers["round_robin"], victim_url, {**story, "stream": True}) as resp:
        lines = resp.iter_lines()
        events = [json.loads(next(line for line in lines if line.startswith("data: {"))[6:])]
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_complete, router, p, max_tokens=6) for p in prompts]
            for future in futures[:8]:
                done.append(future.result())
            # Frozen first, so that a request is surely in flight there when it dies (its
            # short requests were otherwise all answered before the kill now and then).
            victim.send_signal(signal.SIGSTOP)
            deadline = time.monotonic() + 30
            while not any(w["url"] == victim_url and w["in_flight"]
                          for w in admin_workers(router)):
                assert time.monotonic() < deadline, "nothing in flight on the frozen victim"
                time.sleep(0.05)
            victim.kill()  # while the rest are queued or running on all three
            victim.wait()
            done += [future.result() for future in futures[8:]]  # none may fail
        events += [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "replica_failed"
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert whole.startswith(text) and len(text) < len(whole)
    assert [text for text, _, _ in done] == expected
    assert any(worker == victim_url for _, worker, _ in done[:8])
    assert _rerouted(router, victim_url) > rerouted  # in flight there when it died
    workers = {w["url"]: w for w in admin_workers(router)}
    assert not workers[victim_url]["healthy"]
    assert sum(w["in_flight"] for w in workers.values()) == 0  # nothing counted twice
    port = int(victim_url.rsplit(":", 1)[1])
    # back on the same address (and stopped by the fixture from now on)
    replica_procs[1] = list(_replica(qwen3_checkpoint, port=port))
    for base in (router, routers["round_robin"]):
        deadline = time.monotonic() + 10
        while not {w["url"]: w for w in admin_workers(base)}[victim_url]["healthy"]:
            assert time.monotonic() < deadline, "the restarted replica was not re-admitted"
            time.sleep(0.1)
    # It restarted with an empty cache and new KV-event sockets: the router's index of it
    # started over before it was re-admitted, and follows its new events from then on.
    assert {w["url"]: w for w in admin_workers(router)}[victim_url]["indexed_blocks"] == 0
    indexed = _indexed_blocks(router)
    # (round robin: least load would pick it only once its count of routed requests, which
    # stood still while it was dead, is the lowest)
    assert victim_url in {_complete(routers["round_robin"], p)[1] for p in prompts[:3]}
    _wait_indexed(router, victim_url, indexed)


def _families(url: str) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _check_cluster_metrics(router: str, replicas: list[str]) -> None:
    """One scrape of the router sees every replica's series (vLLM names here), each
    labelled with the engine number the replica gives itself, beside the router's own."""
    cluster = _families(router)
    running = cluster["vllm:num_requests_running"].samples
    assert sorted(s.labels["engine"] for s in running) == ["0", "1"]
    assert {s.labels["model_name"] for s in running} == {MODEL}
    generated = [s.value for s in cluster["vllm:generation_tokens"].samples
                 if s.name == "vllm:generation_tokens_total"]
    assert len(generated) == 2 and sum(generated) == 6  # the one completion, on one of them
    assert "openinfer_router:worker_requests" in cluster
    for engine, url in enumerate(replicas):  # the router's numbering: its list of replicas
        own = {s.labels.get("engine") for f in _families(url).values() for s in f.samples}
        assert own == {str(engine)}, url
