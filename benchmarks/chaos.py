"""Chaos: the soak's mixed requests against a prefill and a decode instance behind the router
(``--disaggregate 1:1``) while faults are injected one after another, each with its outcome.

Load runs throughout: ``--concurrency`` clients sending the soak's mix (benchmarks/soak.py:
completions, chat and Anthropic messages, streams and not, n = 2, client aborts, bad
requests). Meanwhile, in turn:

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

    .venv/bin/python benchmarks/chaos.py [--concurrency 32] [--lease 4] [--no-write]

Figures go to docs/reliability.md (section "chaos-pd").
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import signal
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


async def inject(sampler: Sampler, urls: dict[str, str], lease_s: float,
                 faults: list[Fault]) -> None:
    """The faults, one after another, 4 s of plain load between them."""
    procs = sampler.procs()
    decode = [procs["decode 0"], procs["decode 0 engine core"]]
    prefill_api = procs["prefill 1"]

    async def fault(name: str, allowed: frozenset[str] = frozenset()) -> Fault:
        await asyncio.sleep(4)
        faults.append(Fault(name, allowed, start=time.monotonic()))
        print(f"fault: {name}", flush=True)
        return faults[-1]

    f = await fault("slow puller: decode engine stopped 1 s, 3 times")
    for _ in range(3):
        signal_all(decode[1:], signal.SIGSTOP)
        await asyncio.sleep(1)
        signal_all(decode[1:], signal.SIGCONT)
        await asyncio.sleep(1)
    f.end = time.monotonic()

    f = await fault(f"decode instance stopped {lease_s + 4:.0f} s (lease {lease_s:g} s)",
                    frozenset({"503 no healthy decode"}))
    leases_before = await asyncio.to_thread(gauge, urls["prefill"], "kv_leases")
    signal_all(decode, signal.SIGSTOP)
    freed = await wait_for(lambda: gauge(urls["prefill"], "kv_leases") == 0, lease_s + 4)
    await asyncio.sleep(max(0.0, lease_s + 4 - (time.monotonic() - f.start)))
    signal_all(decode, signal.SIGCONT)
    readmitted = await wait_for(lambda: healthy(urls["decode"]), 30)
    f.end = time.monotonic()
    f.observed += [f"prefill leases held when stopped: {leases_before:g}",
                   "all leases expired while stopped: "
                   + (f"yes, {freed:.1f} s after the stop" if freed is not None else "NO"),
                   f"decode healthy again {readmitted:.1f} s after the continue"
                   if readmitted is not None else "decode NOT healthy again within 30 s"]

    f = await fault("prefill engine killed (SIGKILL) under load")
    engine = sampler.procs()["prefill 1 engine core"]
    engine.kill()

    def restarted() -> bool:  # a new engine process, and the instance answering again
        new = sampler.procs().get("prefill 1 engine core")
        return new is not None and new.pid != engine.pid and healthy(urls["prefill"])

    back = await wait_for(restarted, 120)
    await asyncio.sleep(4)  # prefills again, through the restarted engine
    f.end = time.monotonic()
    f.observed.append(f"prefill instance healthy again (new engine) {back:.1f} s after"
                      if back is not None else "prefill instance NOT healthy within 120 s")

    f = await fault("prefill instance killed (SIGKILL): decode alone from now on")
    for child in prefill_api.children(recursive=True):
        child.kill()
    prefill_api.kill()
    await asyncio.sleep(8)
    f.end = time.monotonic()


async def load(base: str, concurrency: int, stop: asyncio.Event,
               finished: list[Finished]) -> None:
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as http:
        counter = iter(range(10**9))

        async def client() -> None:
            for i in counter:
                if stop.is_set():
                    return
                start = time.monotonic()
                kind, outcome = await run_one(http, i)
                if outcome == "503":
                    outcome = "503 no healthy decode"  # (checked against the fault windows)
                finished.append(Finished(start, time.monotonic(), kind, outcome))

        await asyncio.gather(*(client() for _ in range(concurrency)))


async def chaos(base: str, sampler: Sampler, urls: dict[str, str], concurrency: int,
                lease_s: float) -> tuple[list[Fault], list[Finished]]:
    faults: list[Fault] = []
    finished: list[Finished] = []
    stop = asyncio.Event()
    traffic = asyncio.create_task(load(base, concurrency, stop, finished))
    try:
        await inject(sampler, urls, lease_s, faults)
        await asyncio.sleep(4)
    finally:
        stop.set()
        await traffic
    return faults, finished


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--lease", type=float, default=4.0, help="--kv-lease-timeout, s")
    parser.add_argument("--model", help="checkpoint (default: the tiny demo model)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    model = ensure_demo_model(args.model)
    with tempfile.TemporaryDirectory() as store:
        base, proc = start_server(
            model, "--served-model-name", "soak", "--disaggregate", "1:1",
            "--kv-cache-memory", "64MiB", "--kv-host-memory", "128MiB", "--kv-store-dir", store,
            "--max-model-len", "1024", "--kv-lease-timeout", str(args.lease),
            "--restart-on-engine-failure")
        sampler = Sampler(proc.pid)
        try:
            names = sampler.procs()
            urls = {}
            for url in replica_urls(proc.pid):
                port = url.rsplit(":", 1)[1]
                role = next(n for n, p in names.items() if n in ("decode 0", "prefill 1")
                            and "--port" in p.cmdline()
                            and p.cmdline()[p.cmdline().index("--port") + 1] == port)
                urls[role.split()[0]] = url
            start = time.monotonic()
            faults, finished = asyncio.run(chaos(base, sampler, urls, args.concurrency,
                                                 args.lease))
            elapsed = time.monotonic() - start
            idle = idle_state([urls["decode"]])
            router_alive = proc.poll() is None
            decode_alive = all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                               for n, p in sampler.procs().items() if n.startswith("decode"))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    report(args, faults, finished, elapsed, idle, router_alive and decode_alive)


def report(args: argparse.Namespace, faults: list[Fault], finished: list[Finished],
           elapsed: float, idle: dict, alive: bool) -> None:
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
    lines = [
        "## Chaos: faults under load against a prefill and a decode instance behind the "
        "router (`--disaggregate 1:1`, benchmarks/chaos.py)",
        "",
        f"{len(finished)} requests from {args.concurrency} clients in {elapsed:.0f} s (the "
        "soak's mix: completions, chat and Anthropic messages, half streamed, n = 2, client "
        "aborts, bad requests; L2 and L3 on; `--kv-lease-timeout "
        f"{args.lease:g} --restart-on-engine-failure`). Faults one after another, 4 s of plain "
        "load between them; a request counts toward a fault when it overlaps the fault's "
        "window (until 2 s after it).",
        "",
        "| fault | lasted | requests overlapping | their outcomes | observed |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "All requests: " + ", ".join(f"{o}: {c}" for o, c in sorted(totals.items())) + ".",
        "",
        f"**Unexpected outcomes: {sum(unexpected.values())}**"
        + (f" ({dict(unexpected)})" if unexpected else
           " (every request got its answer, its 4xx or its abort, or a 503 while the only "
           "decode instance was stopped)")
        + f". Router and decode instance alive at the end: {alive}. Decode instance "
        "afterwards: " + ", ".join(f"{k} {v:g}" for k, v in idle.items()) + ".",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(REPO / "docs" / "reliability.md", "chaos-pd", body)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
