"""Chaos: the soak's mixed requests against the router while faults are injected one after
another, each with its outcome; ``--topology pd`` (a prefill and a decode instance,
``--disaggregate 1:1``, the default) or ``dp2`` (two data-parallel replicas,
``--data-parallel-size 2``).

Load runs throughout: ``--concurrency`` clients sending the soak's mix (benchmarks/soak.py:
completions, chat and Anthropic messages, streams and not, n = 2, client aborts, bad
requests). Meanwhile, in turn, for ``pd``:

1. slow puller: the decode engine process is stopped (SIGSTOP) for 1 s, three times, so its
   pulls stall within the KV lease;
2. a decode instance that never pulls: the whole decode instance is stopped for longer than
   the lease (``--kv-lease-timeout``); the prefill instance's leases must expire and free
   their blocks while it is stopped; the router ejects it (new requests get 503 with nobody
   to decode) and re-admits it when it is continued;
3. prefill killed mid-transfer: the prefill engine process is killed (SIGKILL) under load; the
   router's prefill legs fail and the decode instance computes the prompt itself, its pulls
   from the dead process fail over to recomputation; the instance restarts its engine
   (``--restart-on-engine-failure``) and prefills again;
4. the prefill instance killed outright: everything is decoded without it from then on.

Every request must end in its expected outcome (an answer, its 4xx, its abort); the only
other outcome allowed is a 503 while no decode instance is healthy (fault 2). Afterwards the
decode instance must be idle with its KV usage 0.

For ``dp2``:

1. a replica that stops answering: replica 0 (API and engine) is stopped for longer than the
   router gives a stalled stream; the router ejects it, sends what it had not started
   elsewhere, ends the streams it had started with an error event, and re-admits it;
2. an engine killed under load: replica 0's engine process is killed (SIGKILL); its
   streams end with an error event, what it had not answered goes to replica 1, and it
   restarts its engine (``--restart-on-engine-failure``);
3. a rolling restart: each replica in turn is drained (``POST /admin/workers/drain``),
   stopped (SIGTERM), started again on its address with an empty cache, and undrained: no
   request may fail;
4. replica 1 killed outright (SIGKILL): its streams end with an error event, everything
   else is served by replica 0.

Every request must end in its expected outcome, or (only while a fault allows it) a stream
ended by an error event. Afterwards replica 0 must be idle with its KV usage 0.

    .venv/bin/python benchmarks/chaos.py [--topology pd|dp2] [--concurrency 32] [--lease 4]
        [--no-write]

Figures go to docs/reliability.md (sections "chaos-pd" and "chaos-dp2").
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from bench_server import ensure_demo_model, start_server
from doc_sections import write_section
from soak import BAD, Sampler, idle_state, replica_urls, run_one

REPO = Path(__file__).resolve().parent.parent
EXPECTED = {"ok", "aborted"} | {f"expected {s}" for _, _, s in BAD}
STREAM_ERROR = "error event"
"""A stream that ended with an error event after some of its text (soak.run_one)."""
ADMIN_KEY = "chaos-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@dataclass
class Fault:
    name: str
    allowed: frozenset[str] = frozenset()
    """Outcomes besides EXPECTED that requests overlapping this fault may end in."""
    start: float = 0.0
    end: float = 0.0
    observed: list[str] = field(default_factory=list)


@dataclass
class Finished:
    start: float
    end: float
    kind: str
    outcome: str


def gauge(base: str, name: str) -> float | None:
    try:
        text = httpx.get(f"{base}/metrics", timeout=2).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith((f"openinfer:{name} ", f"openinfer:{name}{{")):
            return float(line.rsplit(" ", 1)[1])
    return None


def healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


async def wait_for(what, timeout_s: float, step_s: float = 0.2) -> float | None:
    """Seconds until ``what()`` held, or None after the timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if await asyncio.to_thread(what):
            return time.monotonic() - start
        await asyncio.sleep(step_s)
    return None


def signal_all(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):  # (already gone)
            proc.send_signal(sig)


def tree(proc: psutil.Process) -> list[psutil.Process]:
    """A process and its descendants (a replica: its API process and its engine core)."""
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return [proc]


def gone(procs: list[psutil.Process]) -> bool:
    """Every process exited (a zombie counts: it holds no port any more)."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                return False
    return True


def worker_view(router: str, url: str) -> dict:
    """The router's view of one replica (GET /admin/workers), {} if it did not answer."""
    try:
        workers = httpx.get(f"{router}/admin/workers", headers=ADMIN, timeout=5).json()
        return next((w for w in workers["workers"] if w["url"] == url), {})
    except (httpx.HTTPError, ValueError, KeyError):
        return {}


async def begin(faults: list[Fault], name: str, allowed: frozenset[str] = frozenset()) -> Fault:
    """The next fault, after 4 s of plain load."""
    await asyncio.sleep(4)
    faults.append(Fault(name, allowed, start=time.monotonic()))
    print(f"fault: {name}", flush=True)
    return faults[-1]


@dataclass
class Topology:
    """What runs behind the router, and what must be alive and idle after the faults."""
    text: str
    survivors: list[str] = field(default_factory=list)
    """Replica URLs that must end alive and idle (set by the faults)."""
    spawned: list[subprocess.Popen] = field(default_factory=list)
    """Replicas the faults started again themselves: stopped at the end."""
    renamed: dict[str, str] = field(default_factory=dict)
    """Outcomes by what they mean here (checked against the faults' windows)."""


async def inject_pd(sampler: Sampler, urls: dict[str, str], router: str, lease_s: float,
                    faults: list[Fault], topology: Topology) -> None:
    procs = sampler.procs()
    decode = [procs["decode 0"], procs["decode 0 engine core"]]
    prefill_api = procs["prefill 1"]
    topology.survivors = [urls["decode 0"]]

    f = await begin(faults, "slow puller: decode engine stopped 1 s, 3 times")
    for _ in range(3):
        signal_all(decode[1:], signal.SIGSTOP)
        await asyncio.sleep(1)
        signal_all(decode[1:], signal.SIGCONT)
        await asyncio.sleep(1)
    f.end = time.monotonic()

    f = await begin(faults, f"decode instance stopped {lease_s + 4:.0f} s (lease {lease_s:g} s)",
                    frozenset({"503 no healthy decode"}))
    leases_before = await asyncio.to_thread(gauge, urls["prefill 1"], "kv_leases")
    signal_all(decode, signal.SIGSTOP)
    freed = await wait_for(lambda: gauge(urls["prefill 1"], "kv_leases") == 0, lease_s + 4)
    await asyncio.sleep(max(0.0, lease_s + 4 - (time.monotonic() - f.start)))
    signal_all(decode, signal.SIGCONT)
    readmitted = await wait_for(lambda: healthy(urls["decode 0"]), 30)
    f.end = time.monotonic()
    f.observed += [f"prefill leases held when stopped: {leases_before:g}",
                   "all leases expired while stopped: "
                   + (f"yes, {freed:.1f} s after the stop" if freed is not None else "NO"),
                   f"decode healthy again {readmitted:.1f} s after the continue"
                   if readmitted is not None else "decode NOT healthy again within 30 s"]

    f = await begin(faults, "prefill engine killed (SIGKILL) under load")
    back = await kill_engine(sampler, "prefill 1", urls["prefill 1"])
    await asyncio.sleep(4)  # prefills again, through the restarted engine
    f.end = time.monotonic()
    f.observed.append(f"prefill instance healthy again (new engine) {back:.1f} s after"
                      if back is not None else "prefill instance NOT healthy within 120 s")

    f = await begin(faults, "prefill instance killed (SIGKILL): decode alone from now on")
    signal_all(tree(prefill_api), signal.SIGKILL)
    await asyncio.sleep(8)
    f.end = time.monotonic()


async def kill_engine(sampler: Sampler, replica: str, url: str) -> float | None:
    """Kill ``replica``'s engine process; seconds until a new one answers, or None."""
    engine = sampler.procs()[f"{replica} engine core"]
    engine.kill()

    def restarted() -> bool:  # a new engine process, and the instance answering again
        new = sampler.procs().get(f"{replica} engine core")
        return new is not None and new.pid != engine.pid and healthy(url)

    return await wait_for(restarted, 120)


STALLED_FOR_S = 12
"""How long replica 0 is stopped: past the router's 10 s grace for a stalled stream."""


async def inject_dp2(sampler: Sampler, urls: dict[str, str], router: str, lease_s: float,
                     faults: list[Fault], topology: Topology) -> None:
    procs = sampler.procs()
    api = {name: procs[name] for name in ("replica 0", "replica 1")}
    topology.survivors = [urls["replica 0"]]

    def in_rotation(url: str) -> bool:
        return bool(worker_view(router, url).get("healthy"))

    f = await begin(faults, f"replica 0 stops answering (API and engine stopped "
                            f"{STALLED_FOR_S} s)", frozenset({STREAM_ERROR}))
    stopped = tree(api["replica 0"])
    signal_all(stopped, signal.SIGSTOP)
    ejected = await wait_for(lambda: not in_rotation(urls["replica 0"]), STALLED_FOR_S)
    await asyncio.sleep(max(0.0, STALLED_FOR_S - (time.monotonic() - f.start)))
    signal_all(stopped, signal.SIGCONT)
    readmitted = await wait_for(lambda: in_rotation(urls["replica 0"]), 30)
    f.end = time.monotonic()
    f.observed += [f"ejected {ejected:.1f} s after the stop" if ejected is not None
                   else "NOT ejected while stopped",
                   f"re-admitted {readmitted:.1f} s after the continue" if readmitted is not None
                   else "NOT re-admitted within 30 s"]

    f = await begin(faults, "replica 0's engine killed (SIGKILL) under load",
                    frozenset({STREAM_ERROR}))
    back = await kill_engine(sampler, "replica 0", urls["replica 0"])
    await asyncio.sleep(4)
    f.end = time.monotonic()
    f.observed.append(f"replica 0 healthy again (new engine) {back:.1f} s after"
                      if back is not None else "replica 0 NOT healthy within 120 s")

    f = await begin(faults, "rolling restart: each replica drained, stopped (SIGTERM), started "
                            "again with an empty cache, undrained")
    for name in ("replica 0", "replica 1"):
        url, proc = urls[name], api[name]
        argv, cwd, old = proc.cmdline(), proc.cwd(), tree(proc)
        start = time.monotonic()
        drained = await asyncio.to_thread(httpx.post, f"{router}/admin/workers/drain",
                                          json={"url": url, "timeout_s": 120}, headers=ADMIN,
                                          timeout=150)
        drain_s = time.monotonic() - start
        proc.terminate()
        exited = await wait_for(lambda old=old: gone(old), 60)
        indexed = worker_view(router, url).get("indexed_blocks")
        topology.spawned.append(subprocess.Popen(argv, cwd=cwd))
        api[name] = psutil.Process(topology.spawned[-1].pid)
        up = await wait_for(lambda url=url: healthy(url), 300)
        await asyncio.to_thread(httpx.post, f"{router}/admin/workers/undrain", json={"url": url},
                                headers=ADMIN, timeout=30)
        readmitted = await wait_for(lambda url=url: in_rotation(url), 30)
        after = worker_view(router, url).get("indexed_blocks")
        f.observed.append(
            f"{name}: drained in {drain_s:.1f} s (drain answered {drained.status_code}), exited "
            + (f"{exited:.1f} s after SIGTERM" if exited is not None else "NOT within 60 s")
            + (f", answering again {up:.1f} s after its start" if up is not None
               else ", NOT answering within 300 s")
            + (f", back in rotation {readmitted:.1f} s after the undrain" if readmitted is not None
               else ", NOT back in rotation")
            + f"; router's index of it: {indexed} blocks before the restart, {after} when "
            "re-admitted")
    f.end = time.monotonic()

    f = await begin(faults, "replica 1 killed (SIGKILL): replica 0 alone from now on",
                    frozenset({STREAM_ERROR}))
    signal_all(tree(api["replica 1"]), signal.SIGKILL)
    await asyncio.sleep(8)
    f.end = time.monotonic()


TOPOLOGIES = {
    "pd": (inject_pd, ("--disaggregate", "1:1"), "a prefill and a decode instance behind the "
           "router (`--disaggregate 1:1`)", "Router and decode instance"),
    "dp2": (inject_dp2, ("--data-parallel-size", "2"), "two data-parallel replicas behind the "
            "router (`--data-parallel-size 2`)", "Router and replica 0"),
}


async def load(base: str, concurrency: int, stop: asyncio.Event, finished: list[Finished],
               renamed: dict[str, str]) -> None:
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as http:
        counter = iter(range(10**9))

        async def client() -> None:
            for i in counter:
                if stop.is_set():
                    return
                start = time.monotonic()
                kind, outcome = await run_one(http, i)
                finished.append(Finished(start, time.monotonic(), kind,
                                         renamed.get(outcome, outcome)))

        await asyncio.gather(*(client() for _ in range(concurrency)))


async def chaos(inject, base: str, sampler: Sampler, urls: dict[str, str], concurrency: int,
                lease_s: float, topology: Topology) -> tuple[list[Fault], list[Finished]]:
    faults: list[Fault] = []
    finished: list[Finished] = []
    stop = asyncio.Event()
    traffic = asyncio.create_task(load(base, concurrency, stop, finished,
                                           topology.renamed))
    try:
        await inject(sampler, urls, base, lease_s, faults, topology)
        await asyncio.sleep(4)
    finally:
        stop.set()
        await traffic
    return faults, finished


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", choices=sorted(TOPOLOGIES), default="pd")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--lease", type=float, default=4.0, help="--kv-lease-timeout, s")
    parser.add_argument("--model", help="checkpoint (default: the tiny demo model)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    model = ensure_demo_model(args.model)
    inject, flags, text, survivors_text = TOPOLOGIES[args.topology]
    topology = Topology(text)
    if args.topology == "pd":  # (a 503 is allowed only while no decode instance answers)
        topology.renamed["503"] = "503 no healthy decode"
    with tempfile.TemporaryDirectory() as store:
        base, proc = start_server(
            model, "--served-model-name", "soak", *flags,
            "--kv-cache-memory", "64MiB", "--kv-host-memory", "128MiB", "--kv-store-dir", store,
            "--max-model-len", "1024", "--kv-lease-timeout", str(args.lease),
            "--restart-on-engine-failure", "--admin-api-key", ADMIN_KEY)
        sampler = Sampler(proc.pid)
        try:
            names = sampler.procs()
            urls = {}  # by the replica's name: "decode 0", "prefill 1", "replica 0", ...
            for url in replica_urls(proc.pid):
                port = url.rsplit(":", 1)[1]
                urls[next(n for n, p in names.items() if "engine" not in n
                          and "--port" in p.cmdline()
                          and p.cmdline()[p.cmdline().index("--port") + 1] == port)] = url
            start = time.monotonic()
            faults, finished = asyncio.run(chaos(inject, base, sampler, urls, args.concurrency,
                                                 args.lease, topology))
            elapsed = time.monotonic() - start
            idle = idle_state(topology.survivors)
            alive = proc.poll() is None and all(healthy(url) for url in topology.survivors)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            for replica in topology.spawned:
                if replica.poll() is None:
                    replica.terminate()
                    replica.wait(timeout=60)
    report(args, topology, survivors_text, faults, finished, elapsed, idle, alive)


def report(args: argparse.Namespace, topology: Topology, survivors: str, faults: list[Fault],
           finished: list[Finished], elapsed: float, idle: dict, alive: bool) -> None:
    def during(fault: Fault, req: Finished) -> bool:
        return req.end >= fault.start and req.start <= fault.end + 2

    unexpected: collections.Counter = collections.Counter()
    rows = []
    for fault in faults:
        outcomes = collections.Counter(r.outcome for r in finished if during(fault, r))
        rows.append(f"| {fault.name} | {fault.end - fault.start:.0f} s | {sum(outcomes.values())} "
                    "| " + ", ".join(f"{o}: {c}" for o, c in sorted(outcomes.items()))
                    + " | " + "; ".join(fault.observed) + " |")
    for req in finished:
        if req.outcome in EXPECTED:
            continue
        if not any(during(f, req) and req.outcome in f.allowed for f in faults):
            unexpected[f"{req.kind}: {req.outcome}"] += 1
    totals = collections.Counter(r.outcome for r in finished)
    allowed = sorted({o for f in faults for o in f.allowed})
    lease = f"--kv-lease-timeout {args.lease:g} " if args.topology == "pd" else ""
    lines = [
        f"## Chaos: faults under load against {topology.text} (benchmarks/chaos.py)",
        "",
        f"{len(finished)} requests from {args.concurrency} clients in {elapsed:.0f} s (the "
        "soak's mix: completions, chat and Anthropic messages, half streamed, n = 2, client "
        f"aborts, bad requests; L2 and L3 on; `{lease}--restart-on-engine-failure`). Faults one "
        "after another, 4 s of plain load between them; a request counts toward a fault when "
        "it overlaps the fault's window (until 2 s after it).",
        "",
        "| fault | lasted | requests overlapping | their outcomes | observed |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "All requests: " + ", ".join(f"{o}: {c}" for o, c in sorted(totals.items())) + ".",
        "",
        f"**Unexpected outcomes: {sum(unexpected.values())}**"
        + (f" ({dict(unexpected)})" if unexpected else
           " (every request got its answer, its 4xx or its abort"
           + (", or, overlapping a fault that allows it, " + " or ".join(allowed) if allowed
              else "") + ")")
        + f". {survivors} alive at the end: {alive}. Afterwards: "
        + ", ".join(f"{k} {v:g}" for k, v in idle.items()) + ".",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(REPO / "docs" / "reliability.md", f"chaos-{args.topology}", body)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
