"""Soak: many mixed requests against one real server with the L2 (host) and L3 (file) KV
tiers on, checking that nothing is lost and nothing grows.

The mix (seeded): completions and chat completions, streamed and not, some with n = 2;
Anthropic messages; 10% of streams closed by the client after their first chunk (aborts);
5% bad requests (each must get its 4xx); short and long prompts, most starting with one of
a few shared prefixes (prefix-cache and tier traffic). Every request must end in its
expected outcome: an answer, a well-formed error, or the abort. Afterwards the engine must
be idle with its KV usage back to 0; the resident memory, open files and threads of the
server and its engine process are sampled throughout (start after warm-up, peak, end).

    .venv/bin/python benchmarks/soak.py [--requests 10000] [--concurrency 32]
        [--topology single|dp2|pd] [--no-write]

``--topology``: one server (the default); ``dp2``, two data-parallel replicas behind the
cache-aware router (``--data-parallel-size 2``); ``pd``, a prefill and a decode instance behind
it (``--disaggregate 1:1``). Every process of the topology is sampled, every replica must end
idle, and a prefill instance must end holding no KV lease.

Figures go to docs/reliability.md (one section per topology).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
from bench_server import ensure_demo_model, start_server
from doc_sections import write_section

REPO = Path(__file__).resolve().parent.parent
WORDS = ["cache", "block", "token", "prefix", "tier", "store", "decode", "prefill", "router",
         "replica", "batch", "step", "window", "expert", "rank", "lease", "event", "request"]
PREFIXES = [" ".join(random.Random(p).choices(WORDS, k=120)) for p in range(6)]
BAD = [  # (path, body, the status it must get)
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "no_such_field": 1}, 400),
    ("/v1/completions", {"prompt": "hi", "n": 10_000}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**7}, 400),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404),
]


TOPOLOGIES = {  # name: (serve flags, what the doc section calls it, its section)
    "single": ((), "one server", "soak"),
    "dp2": (("--data-parallel-size", "2"), "two data-parallel replicas behind the router "
            "(`--data-parallel-size 2`)", "soak-dp2"),
    "pd": (("--disaggregate", "1:1"), "a prefill and a decode instance behind the router "
           "(`--disaggregate 1:1`)", "soak-pd"),
}


def prompt_text(rng: random.Random) -> str:
    suffix = " ".join(rng.choices(WORDS, k=rng.choice((8, 40, 300))))
    return suffix if rng.random() < 0.2 else f"{rng.choice(PREFIXES)} {suffix}"


def plan(i: int) -> tuple[str, str, dict, int | None]:
    """Request ``i``: (kind, path, body, the 4xx it must get or None)."""
    rng = random.Random(i)
    if rng.random() < 0.05:
        path, body, status = rng.choice(BAD)
        return "bad", path, {"model": "soak", "max_tokens": 4, **body}, status
    text, tokens = prompt_text(rng), rng.choice((4, 16, 48))
    stream = rng.random() < 0.5
    kind = rng.choice(("completions", "chat", "messages"))
    if kind == "completions":
        body = {"prompt": text, "n": 2 if rng.random() < 0.1 else 1}
        path = "/v1/completions"
    elif kind == "chat":
        body = {"messages": [{"role": "user", "content": text}]}
        path = "/v1/chat/completions"
    else:
        body = {"messages": [{"role": "user", "content": text}]}
        path = "/v1/messages"
    body.update(model="soak", max_tokens=tokens, stream=stream, temperature=0.8)
    if kind != "messages":  # (Anthropic's API has no seed)
        body["seed"] = i
    if stream and rng.random() < 0.2:  # 10% of all requests
        return "abort", path, body, None
    return f"{kind}{'_stream' if stream else ''}", path, body, None


async def run_one(http: httpx.AsyncClient, i: int) -> tuple[str, str]:
    kind, path, body, want = plan(i)
    try:
        if body.get("stream"):
            async with http.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    return kind, _status(resp, want)
                async for line in resp.aiter_lines():
                    if kind == "abort" and line.startswith("data:"):
                        return kind, "aborted"  # closing the stream aborts the request
                    if _error_event(line):
                        print(f"request {i}: error event {line[:300]}", flush=True)
                        return kind, "error event"
                return kind, "ok"
        resp = await http.post(path, json=body)
        return kind, _status(resp, want)
    except httpx.HTTPError as e:
        return kind, f"transport {type(e).__name__}"


def _error_event(line: str) -> bool:
    """An SSE line that reports an error: OpenAI's ``data: {"error": ...}``, Anthropic's
    ``event: error``."""
    if line.strip() == "event: error":
        return True
    if not line.startswith("data:") or line.strip() == "data: [DONE]":
        return False
    try:
        event = json.loads(line[5:])
    except ValueError:
        return True  # not JSON: broken
    return isinstance(event, dict) and ("error" in event or event.get("type") == "error")


def _status(resp: httpx.Response, want: int | None) -> str:
    if resp.status_code == 200:
        return "ok" if want is None else "200 (expected an error)"
    try:
        error = resp.json().get("error") or {}
        shaped = isinstance(error, dict) and error.get("message") and error.get("type")
    except (ValueError, AttributeError):
        shaped = False
    if resp.status_code == want and shaped:
        return f"expected {want}"
    return f"{resp.status_code}{'' if shaped else ' (malformed)'}"


class Sampler:
    """RSS, open files and threads of the server and its descendants, every 0.5 s."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: dict[str, list[tuple[int, int, int]]] = collections.defaultdict(list)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._names: dict[int, str] = {}

    def procs(self) -> dict[str, psutil.Process]:
        """The processes by name: the server (the router, when it started replicas), each
        replica's API process and each engine core."""
        root = psutil.Process(self.pid)
        replicas = replica_urls(self.pid)
        out = {"router" if replicas else "api server": root}
        for child in root.children(recursive=True):
            if child.pid not in self._names:
                try:
                    argv = child.cmdline()
                    parent = child.parent()
                    parent_argv = parent.cmdline() if parent is not None else []
                except psutil.Error:
                    continue
                if "serve" in argv and "--metrics-engine-index" in argv:
                    self._names[child.pid] = _replica_name(argv)
                elif any("spawn_main" in arg for arg in argv):
                    owner = (_replica_name(parent_argv) + " " if "--metrics-engine-index"
                             in parent_argv else "")
                    self._names[child.pid] = f"{owner}engine core"
                else:
                    continue
            out[self._names[child.pid]] = child
        return out

    def sample(self) -> None:
        for name, proc in self.procs().items():
            try:
                with proc.oneshot():
                    self.samples[name].append((proc.memory_info().rss, proc.num_fds(),
                                               proc.num_threads()))
            except psutil.Error:
                pass

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.sample()

    def start(self) -> None:
        self.samples.clear()
        self.sample()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


async def soak(base: str, n: int, concurrency: int, sampler: Sampler,
               trend: list[tuple[int, dict[str, tuple[float, int]]]]) -> tuple[dict, float]:
    """Run the ``n`` requests; ``trend`` gets each process's RSS (MiB) and threads at every
    tenth."""
    outcomes: collections.Counter = collections.Counter()
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as http:
        for i in range(-8, 0):  # warm-up (not counted): the first requests load kernels
            await run_one(http, i)
        sampler.start()
        start = time.monotonic()
        queue = iter(range(n))

        async def worker() -> None:
            for i in queue:
                outcomes[await run_one(http, i)] += 1
                if (done := sum(outcomes.values())) % max(1, n // 10) == 0:
                    print(f"{done}/{n} requests", flush=True)
                    trend.append((done, {name: (samples[-1][0] / 2**20, samples[-1][2])
                                         for name, samples in sampler.samples.items()}))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - start
    return dict(outcomes), elapsed


def _replica_name(argv: list[str]) -> str:
    role = argv[argv.index("--role") + 1] if "--role" in argv else "replica"
    return f"{role} {argv[argv.index('--metrics-engine-index') + 1]}"


def replica_urls(pid: int) -> list[str]:
    """The URLs of the replicas a `serve --data-parallel-size/--disaggregate` process started
    (from their command lines); [] for a single server."""
    urls = []
    for child in psutil.Process(pid).children():
        try:
            argv = child.cmdline()
        except psutil.Error:
            continue
        if "serve" in argv and "--metrics-engine-index" in argv:
            urls.append(f"http://127.0.0.1:{argv[argv.index('--port') + 1]}")
    return urls


IDLE_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
               "kv_leases")


def idle_state(bases: list[str], timeout_s: float = 60) -> dict:
    """Each engine's gauges (the largest over engines) once nothing runs anywhere, or after
    the timeout. kv_leases: KV a prefill instance still holds for a decode instance."""
    deadline = time.monotonic() + timeout_s
    while True:
        values: dict[str, float] = {}
        for base in bases:
            for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
                for name in IDLE_GAUGES:
                    if line.startswith((f"openinfer:{name} ", f"openinfer:{name}{{")):
                        values[name] = max(values.get(name, 0.0), float(line.rsplit(" ", 1)[1]))
        if all(v == 0 for v in values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--model", help="checkpoint (default: the tiny demo model)")
    parser.add_argument("--topology", choices=sorted(TOPOLOGIES), default="single")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    model = ensure_demo_model(args.model)
    topology_flags, topology_text, section = TOPOLOGIES[args.topology]
    with tempfile.TemporaryDirectory() as store:
        base, proc = start_server(model, "--served-model-name", "soak", "--kv-cache-memory",
                                  "64MiB", "--kv-host-memory", "128MiB", "--kv-store-dir",
                                  store, "--kv-store-bytes", "256MiB", "--max-model-len", "1024",
                                  *topology_flags)
        sampler = Sampler(proc.pid)
        trend: list[tuple[int, dict[str, tuple[float, int]]]] = []
        try:
            outcomes, elapsed = asyncio.run(soak(base, args.requests, args.concurrency, sampler,
                                                 trend))
            replicas = replica_urls(proc.pid)
            idle = idle_state(replicas or [base])
            sampler.stop()
            alive = proc.poll() is None and all(p.is_running() for p in sampler.procs().values())
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    expected = {"ok", "aborted"} | {f"expected {s}" for _, _, s in BAD}
    unexpected = {k: v for k, v in outcomes.items() if k[1] not in expected}
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for (kind, outcome), count in outcomes.items():
        by_kind[kind][outcome] += count
    lines = [
        f"## Soak: mixed requests against {topology_text} with L2 and L3 on "
        "(benchmarks/soak.py)",
        "",
        f"{args.requests} requests, {args.concurrency} at a time, in {elapsed:.0f} s "
        f"({args.requests / elapsed:.1f} requests/s) on the tiny demo model "
        "(`--kv-cache-memory 64MiB --kv-host-memory 128MiB --kv-store-dir`"
        f"{'' if args.topology == 'single' else ', one store directory for every replica'}"
        "): completions, chat "
        "and Anthropic messages, half streamed, 10% of completions with n = 2, 10% of all "
        "aborted by the client mid-stream, 5% bad requests, most prompts behind one of 6 "
        "shared 120-word prefixes.",
        "",
        "| kind | requests | outcomes |",
        "|---|---|---|",
    ]
    for kind in sorted(by_kind):
        counts = by_kind[kind]
        lines.append(f"| {kind} | {sum(counts.values())} | "
                     + ", ".join(f"{o}: {c}" for o, c in sorted(counts.items())) + " |")
    lines += [
        "",
        f"**Unexpected outcomes: {sum(unexpected.values())}**"
        + (f" ({json.dumps({f'{k[0]}: {k[1]}': v for k, v in unexpected.items()})})"
           if unexpected else " (every request got its answer, its 4xx or its abort; no 5xx)")
        + f". Every process alive at the end: {alive}. Engines afterwards (largest over "
        "engines): "
        + ", ".join(f"{k} {v:g}" for k, v in idle.items()) + ".",
        "",
        "| process | RSS start / peak / end | open files start / end | threads start / end |",
        "|---|---|---|---|",
    ]
    order = sorted(sampler.samples, key=lambda name: (name not in ("router", "api server"), name))
    for name in order:
        samples = sampler.samples[name]
        rss = [s[0] / 2**20 for s in samples]
        lines.append(f"| {name} | {rss[0]:.0f} / {max(rss):.0f} / {rss[-1]:.0f} MiB "
                     f"| {samples[0][1]} / {samples[-1][1]} | {samples[0][2]} / {samples[-1][2]} |")
    for what, unit, pick in (("RSS", " MiB", lambda x: f"{x[0]:.0f}"),
                             ("Threads", "", lambda x: f"{x[1]}")):
        lines += ["", f"{what} as the run went on (requests done: " + " / ".join(order)
                  + f"{unit}): " + ", ".join(
                      f"{done}: " + " / ".join(pick(at.get(name, (0, 0))) for name in order)
                      for done, at in trend) + "."]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(REPO / "docs" / "reliability.md", section, body)


if __name__ == "__main__":
    main()
