"""`openinfer router` and `openinfer serve --data-parallel-size N` (replicas + router)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from openinfer.model_source import resolve_model
from openinfer.procs import free_ports, strip_flags
from openinfer.router.policies import POLICIES, RouterConfig
from openinfer.server.listener import base_url, bind_socket, serve
from openinfer.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


def add_router_args(parser: argparse.ArgumentParser, data_parallel: bool = False) -> None:
    """Routing flags; with data_parallel (serve), also where the replicas run."""
    g = parser.add_argument_group("router")
    g.add_argument("--policy", choices=POLICIES, default="cache_aware",
                   help="how a replica is chosen for each request")
    g.add_argument("--balance-abs", type=int, default=8,
                   help="cache_aware falls back to least load when max - min in-flight "
                        "requests exceeds this ...")
    g.add_argument("--balance-rel", type=float, default=1.5,
                   help="... and max exceeds this times min")
    g.add_argument("--disagg-min-tokens", type=int, default=256,
                   help="with prefill instances: disaggregate a request only when the part "
                        "of its prompt the decode instance lacks is at least this long")
    if not data_parallel:
        return
    g.add_argument("--disaggregate", metavar="P:D",
                   help="start P prefill and D decode instances behind the router, which "
                        "sends each long prompt to a prefill instance, then to a decode one")
    g.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="start the --data-parallel-size replicas as local processes, or as "
                        "Ray actors on a Ray cluster (pip install 'openinfer[ray]')")
    g.add_argument("--ray-address",
                   help="Ray cluster to join, e.g. auto or HOST:6379, for --backend ray "
                        "replicas or --distributed-executor-backend ray ranks (default: start "
                        "a local Ray instance)")
    g.add_argument("--ray-num-cpus-per-replica", type=float, default=1,
                   help="CPUs Ray reserves for each replica (also its OMP_NUM_THREADS)")


def cmd_router(args: argparse.Namespace) -> int:
    if not args.worker:
        print("openinfer router: give at least one --worker (or --decode) URL", file=sys.stderr)
        return 2
    args.admin_api_key = args.admin_api_key or os.environ.get("OPENINFER_ADMIN_API_KEY") or None
    sock = bind_socket(args.host, args.port)
    run_router(args.worker, args.tokenizer, args, sock, args.prefill)
    return 0


def run_router(urls: list[str], tokenizer_path: str, args: argparse.Namespace,
               sock: socket.socket, prefill_urls: list[str] = ()) -> None:
    """Serve the router on ``sock`` (bound by the caller before anything slow)."""
    from openinfer.router.app import build_router_app
    from openinfer.router.state import RouterState
    from openinfer.server.prompt import PromptRenderer
    from openinfer.server.sampling_defaults import load_chat_template

    host, port = sock.getsockname()[:2]
    # The replicas' --chat-template (`serve` passes its own on to them and to us), so that
    # the prompts we hash are the ones they run.
    template = getattr(args, "chat_template", None)
    renderer = PromptRenderer(load_tokenizer(tokenizer_path),
                              load_chat_template(template) if template is not None else None)
    config = RouterConfig(policy=args.policy, balance_abs=args.balance_abs,
                          balance_rel=args.balance_rel)
    state = RouterState(urls, config, renderer, args.block_size, prefill_urls,
                        args.disagg_min_tokens,
                        getattr(args, "cache_salt_per_api_key", False),
                        getattr(args, "kv_transfer_secret", None)
                        or os.environ.get("OPENINFER_KV_TRANSFER_SECRET") or None)
    pd = f" (prefill: {', '.join(prefill_urls)})" if prefill_urls else ""
    logger.info("router (%s) over %s%s on http://%s:%s", args.policy, ", ".join(urls), pd, host,
                port)
    keys = getattr(args, "api_key", None) or []
    admin_key = getattr(args, "admin_api_key", None) or (keys[0] if len(keys) == 1 else None)
    serve(build_router_app(state, admin_key), sock, log_level=args.log_level,
          access_log=not getattr(args, "disable_uvicorn_access_log", False),
          timeout_keep_alive=args.timeout_keep_alive)


def serve_data_parallel(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``--data-parallel-size`` replicas of this serve command on free loopback ports
    (or as Ray actors: --backend ray), each publishing KV events, and the router in front
    of them on --host/--port."""
    child_argv = strip_flags(argv, {"--data-parallel-size", "--port", "--host", "--policy",
                               "--balance-abs", "--balance-rel", "--kv-events-endpoint",
                               "--kv-events-replay-endpoint", "--backend", "--ray-address",
                               "--ray-num-cpus-per-replica", "--disaggregate", "--role",
                               "--kv-transfer-port", "--disagg-min-tokens",
                               "--metrics-engine-index", "--data-parallel-rank",
                               "--data-parallel-rpc-port", "--data-parallel-address"})
    sock = bind_socket(args.host, args.port)  # a port in use fails before replicas start
    if args.backend == "ray":
        if args.disaggregate:
            raise SystemExit("--disaggregate runs on this machine: not with --backend ray")
        if args.enable_expert_parallel:
            raise SystemExit("--backend ray does not form the replicas into one "
                             "expert-parallel group yet: start each rank with "
                             "--data-parallel-rank instead")
        return _serve_on_ray(args, child_argv, sock)
    roles = [[]] * args.data_parallel_size
    if args.enable_expert_parallel and args.data_parallel_size > 1:
        # One expert-parallel group: each replica is a rank of it (attention data parallel).
        port, = free_ports(1)
        roles = [["--data-parallel-size", str(args.data_parallel_size), "--data-parallel-rank",
                  str(i), "--data-parallel-rpc-port", str(port)]
                 for i in range(args.data_parallel_size)]
        if args.disaggregate:
            raise SystemExit("--disaggregate with a data-parallel expert-parallel group is not "
                             "supported yet")
    num_prefill = 0
    if args.disaggregate:
        num_prefill, num_decode = _parse_pd(args.disaggregate)
        # A prefill replica's KV server takes a free port; its responses say which.
        roles = [["--role", "prefill"]] * num_prefill + [["--role", "decode"]] * num_decode
    replicas, urls = [], []
    try:
        for i, extra in enumerate(roles):
            # No port is picked here and bound by the replica later (another process could
            # take it in between): the replica gets the socket bound here, and its event
            # sockets take free ports that it reports on GET /kv_events.
            listener = bind_socket("127.0.0.1", 0, announce=False)
            with listener:
                # The router's numbering (its `engine` label): serving replicas, then prefill.
                engine = (i - num_prefill) % len(roles)
                replicas.append(subprocess.Popen([
                    sys.executable, "-m", "openinfer.cli", "serve", *child_argv, *extra,
                    "--listen-fd", str(listener.fileno()), "--metrics-engine-index", str(engine),
                    "--kv-events-endpoint", "tcp://127.0.0.1:*",
                    "--kv-events-replay-endpoint", "tcp://127.0.0.1:*"],
                    pass_fds=[listener.fileno()]))
                urls.append(base_url(listener))
            # (closed here: the replica's copy is the only one, so once it exits its
            # port refuses connections instead of leaving them in a backlog nobody reads)
        for url, proc in zip(urls, replicas):
            _wait_healthy(url, proc)
        # uvicorn re-raises the SIGTERM it drained on; as an exception (not the default
        # action, which would kill us on the spot) it lets `finally` stop the replicas.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        run_router(urls[num_prefill:], _tokenizer_path(args), args, sock, urls[:num_prefill])
    finally:
        for proc in replicas:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in replicas:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


def _parse_pd(text: str) -> tuple[int, int]:
    try:
        p, d = (int(x) for x in text.split(":"))
        assert p >= 1 and d >= 1
        return p, d
    except (ValueError, AssertionError):
        raise SystemExit(f"--disaggregate takes P:D (at least 1 each), got {text!r}") from None


def _tokenizer_path(args: argparse.Namespace) -> str:
    """The replicas' tokenizer: --tokenizer, else the model's (a name resolved to its files)."""
    if args.tokenizer:
        return args.tokenizer
    return resolve_model(args.model).path


def _serve_on_ray(args: argparse.Namespace, child_argv: list[str], sock: socket.socket) -> int:
    from openinfer.router.ray_backend import start_ray_replicas

    # From the start, not after startup as above: a SIGTERM while Ray starts must still
    # reach `finally` (or start_ray_replicas' own cleanup) and stop what has started.
    # Again after: ray.init installs its own handler, which exits with status 15.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    stop = None
    try:
        urls, stop = start_ray_replicas(args, child_argv)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        run_router(urls, _tokenizer_path(args), args, sock)
    finally:
        if stop is not None:
            stop()  # the replicas, then ray.shutdown(): no Ray process outlives us
    return 0


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"replica {url} exited during startup")
        with contextlib.suppress(OSError):
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return
        time.sleep(0.3)
    raise SystemExit(f"replica {url} did not start")
