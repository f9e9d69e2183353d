"""One tensor/context-parallel group over several machines, without Ray (torchrun's names).

    node 0: serve --nnodes 2 -tp 4 --master-addr A      node 1: serve --nnodes 2 --node-rank 1
      engine core ── pipes ──> ranks 0, 1                         -tp 4 --master-addr A
            └───── TCP A:port+1 (authenticated) ──────────> ranks 2, 3 (headless)
      all four ranks: torch.distributed at A:port (gloo / NCCL)

Node 0's executor listens at ``master_port + 1``; each rank of another node connects, says
which rank it is and receives the engine's config from node 0 (so every rank loads the same
model with the same seed), then serves the core's calls over that connection exactly as a
local rank does over its pipe. A rank that dies closes its connection, which fails the
core's call at once; the core's end closing (shutdown, or its death) ends the remote ranks,
and a headless node exits when its ranks have.

The connection is authenticated with ``OPENINFER_NODE_SECRET`` (HMAC challenge, both ways)
before any pickled byte is read. torch.distributed's own rendezvous is not authenticated:
as with torchrun, the nodes must be on a trusted network.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import threading
import time
from dataclasses import replace
from multiprocessing.connection import AuthenticationError, Client, Connection, Listener, wait

from openinfer.config import EngineConfig, NodesConfig
from openinfer.executor.rank import serve_rank
from openinfer.logger import configure_logging
from openinfer.procs import die_with

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 600.0
"""How long node 0 waits for the other nodes' ranks, and they for node 0."""
_DEFAULT_SECRET = b"openinfer-nodes"


def node_secret() -> bytes:
    secret = os.environ.get("OPENINFER_NODE_SECRET")
    return secret.encode() if secret else _DEFAULT_SECRET


def init_method(nodes: NodesConfig) -> str:
    return f"tcp://{nodes.master_addr}:{nodes.master_port}"


class RemoteRanks:
    """Node 0's end: accepts the other nodes' ranks (in a thread, while the local ranks
    start) and hands each the engine's config."""

    def __init__(self, config: EngineConfig, ranks: range) -> None:
        nodes = config.nodes
        if node_secret() == _DEFAULT_SECRET:
            logger.warning("OPENINFER_NODE_SECRET is not set: anyone who reaches %s:%d can "
                           "join this engine's ranks", nodes.master_addr, nodes.master_port + 1)
        self.expected = set(ranks)
        self.conns: dict[int, Connection] = {}
        self._payload = pickle.dumps(config, protocol=pickle.HIGHEST_PROTOCOL)
        # The address the other nodes reach this one at: nothing is served on other interfaces.
        self._listener = Listener((nodes.master_addr, nodes.master_port + 1),
                                  authkey=node_secret())
        threading.Thread(target=self._accept, name="openinfer-node-accept", daemon=True).start()

    @property
    def complete(self) -> bool:
        return len(self.conns) == len(self.expected)

    @property
    def missing(self) -> list[int]:
        return sorted(self.expected - set(self.conns))

    def _accept(self) -> None:
        while not self.complete:
            try:
                conn = self._listener.accept()
            except AuthenticationError as e:
                logger.warning("refused a rank connection: %s (OPENINFER_NODE_SECRET differs?)",
                               e)
                continue
            except OSError:
                return  # closed
            try:
                rank = int(conn.recv_bytes(16))
            except (EOFError, OSError, ValueError):
                conn.close()
                continue
            if rank not in self.expected or rank in self.conns:
                logger.warning("refused rank %d: not one of the other nodes' ranks %s, or "
                               "joined twice", rank, sorted(self.expected))
                conn.close()
                continue
            conn.send_bytes(self._payload)
            self.conns[rank] = conn
            logger.info("rank %d joined from another node", rank)
        self.close()

    def close(self, joined: bool = False) -> None:
        """Stops accepting; ``joined``: also closes the joined ranks' connections (a start
        that failed: those ranks end, and their headless node with them)."""
        self._listener.close()
        if joined:
            for conn in list(self.conns.values()):
                conn.close()


def serve_headless(nodes: NodesConfig, num_ranks: int) -> int:
    """Node ``nodes.node_rank``'s ranks, until they end (the engine on node 0 shut down or
    died, or one of them died: then the others are stopped too)."""
    ranks = nodes.local_ranks(num_ranks)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_remote_rank_main, name=f"openinfer-rank{rank}",
                         args=(nodes, rank, index, len(ranks), os.getpid()))
             for index, rank in enumerate(ranks)]
    for proc in procs:
        proc.start()
    logger.info("node %d of %d: ranks %d..%d joining %s:%d", nodes.node_rank, nodes.nnodes,
                ranks[0], ranks[-1], nodes.master_addr, nodes.master_port + 1)

    def stop(signum, frame) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        pending = list(procs)
        while pending:
            wait([p.sentinel for p in pending])
            done = [p for p in pending if not p.is_alive()]
            pending = [p for p in pending if p.is_alive()]
            if any(p.exitcode != 0 for p in done):
                break
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)
    failed = {p.name: p.exitcode for p in procs if p.exitcode not in (0, -signal.SIGKILL)}
    if failed:
        logger.error("ranks failed: %s", failed)
    return 1 if any(p.exitcode != 0 for p in procs) else 0


def _remote_rank_main(nodes: NodesConfig, rank: int, local_index: int, ranks_here: int,
                      parent_pid: int) -> None:
    die_with(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the headless parent decides when we stop
    configure_logging()
    conn = _connect(nodes)
    conn.send_bytes(str(rank).encode())
    try:
        config = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        raise SystemExit(f"rank {rank}: node 0 refused it (see its log)") from None
    serve_rank(kv_transfer_from_here(config, conn), rank, init_method(nodes), conn,
               progress=False, cuda_index=local_index, ranks_here=ranks_here)


def kv_transfer_from_here(config: EngineConfig, conn: Connection) -> EngineConfig:
    """Node 0's config for a rank of this node: a prefill instance's rank lends its share of
    the blocks from this node, on ``$OPENINFER_KV_TRANSFER_HOST`` (set on this node) or else
    the address this node reaches node 0 from (``--kv-transfer-host`` is node 0's)."""
    kt = config.kv_transfer
    if not kt.serves_kv:
        return config
    host = os.environ.get("OPENINFER_KV_TRANSFER_HOST")
    if not host:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            host = sock.getsockname()[0]
    return replace(config, kv_transfer=replace(kt, host=host))


def _connect(nodes: NodesConfig) -> Connection:
    """Node 0's executor, retried until it listens (the nodes start in any order)."""
    address = (nodes.master_addr, nodes.master_port + 1)
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while True:
        try:
            return Client(address, authkey=node_secret())
        except (ConnectionRefusedError, ConnectionResetError, TimeoutError):
            if time.monotonic() > deadline:
                raise SystemExit(f"node 0 did not listen at {address[0]}:{address[1]} "
                                 f"within {JOIN_TIMEOUT_S:.0f} s") from None
            time.sleep(0.5)
