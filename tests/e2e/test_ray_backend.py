"""`openinfer serve --data-parallel-size 2 --backend ray`: the replicas as Ray actors on a
local Ray instance, behind the router, their KV events reaching it; nothing left behind.
`--distributed-executor-backend ray`: a tensor-parallel group's ranks as Ray actors."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import time

import httpx
import psutil
import pytest
from server_process import MODEL, admin_workers, output, start_server, stop

# Only whether it is installed: importing ray here would change this test process for the
# tests after it (it altered how an offline tokenizer decodes a partial UTF-8 byte).
if importlib.util.find_spec("ray") is None:
    pytest.skip("ray is not installed (pip install 'openinfer[ray]')", allow_module_level=True)


PROMPT = "the replicas started by Ray answer the same thing " * 2  # > one 16-token block


def _complete(base: str) -> tuple[str, str | None, str | None]:
    resp = httpx.post(f"{base}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
        "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return (resp.json()["choices"][0]["text"], resp.headers.get("x-openinfer-worker"),
            resp.headers.get("x-openinfer-route"))


def _workers(base: str) -> list[dict]:
    return admin_workers(base)


def _wait_for(condition, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


@pytest.mark.slow
def test_serve_data_parallel_on_ray(qwen3_checkpoint):
    base, proc = start_server(qwen3_checkpoint, "--data-parallel-size", "2", "--backend", "ray")
    # Ray's processes, the actors, the replicas and their engine cores: all must go with it.
    descendants = psutil.Process(proc.pid).children(recursive=True)
    try:
        urls = [w["url"] for w in _workers(base)]
        assert len(urls) == 2 and not any("127.0.0.1" in u for u in urls)  # the node's address

        text, worker, route = _complete(base)
        assert worker in urls and route != "cache_hit"
        from openinfer import LLM, SamplingParams
        offline = LLM(str(qwen3_checkpoint), progress=False).generate(
            [PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        assert text == offline[0].outputs[0].text  # the reference for every answer below
        # The replica's KV events reach the router's exact index ...
        _wait_for(lambda: any(w["url"] == worker and w["events"] and w["indexed_blocks"]
                              for w in _workers(base)))
        # ... so the repeat goes back to it as a cache hit.
        assert _complete(base) == (text, worker, "cache_hit")
        # Each replica, reached at the address Ray's node gave it, answers the same; now
        # both have published events.
        assert [_complete(url)[0] for url in urls] == [text, text]
        _wait_for(lambda: all(w["healthy"] and w["events"] for w in _workers(base)))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0, output(proc)
    for url in urls:  # the replicas went with it
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=5)
    _, alive = psutil.wait_procs(descendants, timeout=30)
    assert not alive, alive


def _lives(p: psutil.Process) -> bool:
    try:
        return (p.status() != psutil.STATUS_ZOMBIE
                and "resource_tracker" not in " ".join(p.cmdline()))
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_tensor_parallel_ranks_as_ray_actors(qwen3_checkpoint):
    """`serve -tp 2 --distributed-executor-backend ray`: the ranks are Ray actors; the
    answers are one rank's, and an actor that dies turns the server unhealthy and takes
    Ray's processes with the engine (nothing left behind)."""
    from openinfer import LLM, SamplingParams

    want = LLM(str(qwen3_checkpoint), progress=False).generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0].text
    base, proc = start_server(qwen3_checkpoint, "--tensor-parallel-size", "2",
                              "--distributed-executor-backend", "ray")
    try:
        assert _complete(base)[0] == want
        engine = psutil.Process(proc.pid).children(recursive=True)
        ranks = [p for p in engine if "RankActor" in " ".join(p.cmdline())]
        assert len(ranks) == 2
        ranks[1].kill()
        resp = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 50, "ignore_eos": True})
        assert resp.status_code in (500, 503)

        def unhealthy() -> bool:
            health = httpx.get(f"{base}/health", timeout=5)
            return health.status_code == 503 and "ray rank" in health.json()["reason"]

        _wait_for(unhealthy)
        # (but multiprocessing's resource tracker, which outlives its process; a zombie has
        # exited, its parent not having reaped it yet)
        _wait_for(lambda: not any(_lives(p) for p in engine))
        assert proc.poll() is None  # the API process still answers (503s) until stopped
    finally:
        stop(proc)
