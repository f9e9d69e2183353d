"""A rank's process: join the group, load this rank's shard into a Worker, then serve the
engine core's calls from its pipe until shutdown (or until the core is gone)."""

from __future__ import annotations

import logging
import pickle
import signal
import traceback
from dataclasses import replace
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from openinfer.config import EngineConfig
from openinfer.distributed.context_parallel import ContextParallel, set_cp
from openinfer.distributed.parallel_state import COLLECTIVE_TIMEOUT, TensorParallel, set_tp
from openinfer.gc_heap import freeze_heap
from openinfer.logger import configure_logging
from openinfer.procs import die_with
from openinfer.worker.worker import Worker

logger = logging.getLogger(__name__)


def rank_main(config: EngineConfig, rank: int, init_method: str, conn: Connection,
               core_pid: int, progress: bool, ranks_here: int) -> None:
    """A rank's process on the engine's node: it dies with the engine core."""
    die_with(core_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when we stop
    configure_logging()
    serve_rank(config, rank, init_method, conn, progress, cuda_index=rank, ranks_here=ranks_here)


def serve_rank(config: EngineConfig, rank: int, init_method: str, conn: Connection,
               progress: bool, cuda_index: int, ranks_here: int) -> None:
    """Join the group, load this rank's shard, then run the core's calls from ``conn`` until
    shutdown (or until the core is gone)."""
    try:
        worker = start_worker(config, rank, init_method, progress, cuda_index, ranks_here)
    except BaseException as e:
        conn.send_bytes(pickle.dumps(("error", f"{type(e).__name__}: {e}")))
        logger.error("rank %d failed to start: %s", rank, traceback.format_exc())
        return
    freeze_heap(f"rank {rank}")
    conn.send_bytes(pickle.dumps(("ok", None)))
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the core is gone
        try:
            reply = ("ok", getattr(worker, method)(*args))
        except Exception as e:
            logger.error("rank %d: %s failed: %s", rank, method, traceback.format_exc())
            reply = ("error", f"{method}: {type(e).__name__}: {e}")
        try:
            conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            return  # the core is gone
        if method == "shutdown":
            dist.destroy_process_group()
            return


def start_worker(config: EngineConfig, rank: int, init_method: str, progress: bool,
                 cuda_index: int, ranks_here: int | None):
    """Join the group at ``init_method`` as ``rank``, set this process's parallel state,
    and load this rank's worker (on CUDA, on device ``cuda_index``; on a CPU, this machine's
    torch threads divided among the ``ranks_here`` that share it; None: left as they are)."""
    size = config.num_ranks
    cuda = config.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(cuda_index)
        config = replace(config, device=f"cuda:{cuda_index}")
    elif ranks_here:
        torch.set_num_threads(max(1, torch.get_num_threads() // ranks_here))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method,
                            rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    if config.prefill_context_parallel_size > 1:  # every rank holds the whole model
        set_cp(ContextParallel(rank, size, dist.group.WORLD))
    else:
        set_tp(TensorParallel(rank, size, dist.group.WORLD))
    return Worker(config, progress)
