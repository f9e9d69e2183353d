"""`openinfer serve --data-parallel-size N --backend ray`: the replicas as Ray actors.

Ray only places and supervises the replicas: each actor starts and owns one ordinary
`openinfer serve` process on its node, and the router (launch.py) reaches it over HTTP and
its KV events over ZMQ exactly as it reaches a local replica. Ray is an optional
dependency, imported only here and only inside functions, so `import openinfer` never
pulls it in.

On a cluster every node needs openinfer (and its dependencies) installed, and --model
(and --tokenizer, --kv-store-dir) must name paths that exist on every node.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable

from openinfer.procs import PR_SET_PDEATHSIG, free_ports, strip_flags

STARTUP_TIMEOUT_S = 600
STOP_TIMEOUT_S = 60


class ReplicaActor:
    """One `openinfer serve` replica, owned by a Ray actor on the node Ray placed it on.

    A plain class: start_ray_replicas() wraps it with ray.remote at runtime.
    """

    def __init__(self, child_argv: list[str], python: str) -> None:
        self.child_argv = child_argv
        # The driver's interpreter where this node has it (always so on one machine), else
        # the one Ray runs this actor with: either way openinfer must be installed in it.
        self.python = python if os.access(python, os.X_OK) else sys.executable
        self.proc: subprocess.Popen | None = None

    def start(self) -> str:
        """Start the replica on free ports of this node; its URL once it is healthy."""
        import ray


        port, events, replay = free_ports(3, "")
        # 0.0.0.0 and tcp://*: the router usually runs on another node. It learns the event
        # endpoints from the replica's GET /kv_events and puts this node's address in for *.
        # The replica inherits OMP_NUM_THREADS=--ray-num-cpus-per-replica from Ray.
        self.proc = subprocess.Popen(
            [self.python, "-m", "openinfer.cli", "serve", *self.child_argv,
             "--host", "0.0.0.0", "--port", str(port),
             "--kv-events-endpoint", f"tcp://*:{events}",
             "--kv-events-replay-endpoint", f"tcp://*:{replay}"],
            preexec_fn=_die_with_parent())
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica on {ray.util.get_node_ip_address()} exited with "
                                   f"code {self.proc.returncode} during startup (its output "
                                   "is above, or in this node's Ray worker logs)")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                return f"http://{ray.util.get_node_ip_address()}:{port}"
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"replica did not start in {STARTUP_TIMEOUT_S} s")

    def stop(self) -> None:
        """SIGTERM (in-flight requests drain, the engine core stops), then kill."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_ray_replicas(args: argparse.Namespace,
                       child_argv: list[str]) -> tuple[list[str], Callable[[], None]]:
    """Start args.data_parallel_size replica actors; (their URLs, a function that stops
    them and disconnects from Ray, or shuts down the local Ray instance we started)."""
    try:
        import ray
    except ImportError:
        raise SystemExit("openinfer: --backend ray needs Ray: pip install 'openinfer[ray]'") from None

    if args.ray_address:
        ray.init(address=args.ray_address, logging_level="WARNING")
    else:
        # "local": a private instance even if `ray start` left one running on this machine.
        # At least N * cpus-per-replica CPUs, so that all replicas fit on a small machine.
        num_cpus = max(os.cpu_count() or 1,
                       math.ceil(args.data_parallel_size * args.ray_num_cpus_per_replica))
        # Ray's memory monitor kills the actors running tasks when the *node* runs short,
        # whoever uses the memory; a replica sized its KV pool on purpose. The kernel's OOM
        # killer still applies. (A cluster's own settings are its operator's business.)
        os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
        # The object store only carries a few strings; Ray's default reserves 30% of RAM.
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 logging_level="WARNING", object_store_memory=128 * 2**20)
    num_gpus = 0
    if args.device.startswith("cuda"):
        # One GPU each: Ray picks it (CUDA_VISIBLE_DEVICES), so cuda:N would point past it.

        num_gpus = 1
        child_argv = [*strip_flags(child_argv, {"--device"}), "--device", "cuda"]
        have = ray.cluster_resources().get("GPU", 0)
        if not args.ray_address and have < args.data_parallel_size:  # else: pending forever
            ray.shutdown()
            raise SystemExit(f"openinfer: --backend ray gives each replica its own GPU; "
                             f"this machine has {have:g} for {args.data_parallel_size}")
    # SPREAD: one replica per node where the cluster allows, not all on the first node.
    actor_cls = ray.remote(ReplicaActor).options(
        num_cpus=args.ray_num_cpus_per_replica, num_gpus=num_gpus, scheduling_strategy="SPREAD")
    actors = [actor_cls.remote([*child_argv, "--metrics-engine-index", str(i)], sys.executable)
              for i in range(args.data_parallel_size)]

    def stop() -> None:
        # Ask each actor to stop its replica gracefully first: shutting Ray down kills
        # actors outright, which leaves their replicas to the death signal.
        with contextlib.suppress(Exception):
            ray.get([a.stop.remote() for a in actors], timeout=STOP_TIMEOUT_S + 10)
        ray.shutdown()

    try:
        # A cluster without room for N replicas leaves them pending: the timeout says so.
        urls = ray.get([a.start.remote() for a in actors], timeout=STARTUP_TIMEOUT_S)
    except BaseException as e:
        stop()
        if isinstance(e, ray.exceptions.RayTaskError):
            raise SystemExit(f"openinfer: {e.cause}") from None
        raise
    return urls, stop


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that has the kernel SIGTERM the replica when this actor's process dies,
    even by SIGKILL (ray.kill, ray.shutdown, a crashed raylet), so no replica outlives
    its actor. Linux only; elsewhere None. The signal follows the thread that forked: a
    sync actor runs its methods on its process's main thread, so that is the actor's life."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before fork: not fork-safe
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the actor died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec
