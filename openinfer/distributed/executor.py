"""Tensor parallelism: one worker process per rank, driven by the engine core.

    EngineCore ── collective_rpc(method, args) ──┬── pipe ──> rank 0: Worker ─┐
        (one scheduler; the core holds no         ├── pipe ──> rank 1: Worker ─┤ torch.distributed
         tensor and no process group)             └── ...                     ─┘ (gloo / NCCL)

Every call goes to every rank (a step's forward needs them all at once for its
collectives) and the core reads rank 0's result. Each rank samples from the same
all-gathered logits with the same seed, so every rank's runner appends the same tokens
and the next step's inputs agree without a broadcast.

Failure: the core waits on the ranks' pipes and their process sentinels together, so a
rank that dies or raises fails the call at once (no wait on a collective that will never
complete); the executor then kills every rank. Ranks also die with the core (Linux
parent-death signal), so none is left behind.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import random
import signal
import socket
import time
import traceback
import weakref
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from openinfer.config import EngineConfig
from openinfer.distributed.nodes import JOIN_TIMEOUT_S, RemoteRanks, init_method
from openinfer.engine.core_proc import die_with
from openinfer.engine.executor import Executor
from openinfer.gc_heap import freeze_heap

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(minutes=5)
"""Backstop for a collective whose peer hangs (a dead peer fails it at once)."""


def check_context_parallel(config: EngineConfig) -> None:
    """Refuse at start-up what prefill context parallelism cannot run."""
    from openinfer.models.registry import get_model_class

    size, mc = config.prefill_context_parallel_size, config.model
    if size < 1:
        raise ValueError(f"prefill_context_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    if config.tensor_parallel_size > 1:
        raise ValueError("prefill_context_parallel_size with tensor_parallel_size > 1 is not "
                         "supported yet")
    _check_ranks_fit(config, size, "prefill_context_parallel_size")
    if not getattr(get_model_class(mc.architecture), "supports_context_parallel", False):
        raise ValueError(f"prefill_context_parallel_size {size}: {mc.architecture} cannot be "
                         "split by context yet (Llama-family models with full attention can)")
    _refuse_unsupported(config, f"prefill_context_parallel_size {size}",
                        {"expert parallelism": config.enable_expert_parallel,
                         # Verification steps are short: they run whole on every rank,
                         # and token drafts are made alike there. A draft network's own
                         # prefill would be split, and is not taught to be.
                         "speculative decoding with a draft network":
                             config.speculative is not None and config.speculative.uses_model,
                         "--batch-invariant": config.model.batch_invariant})


def check_tensor_parallel(config: EngineConfig) -> None:
    """Refuse at start-up, naming the constraint, what the ranks could not run."""
    size, mc = config.tensor_parallel_size, config.model
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    _check_ranks_fit(config, size, "tensor_parallel_size")
    _check_split(mc.architecture, mc.hf_config, size, config.enable_expert_parallel)
    spec = config.speculative
    if spec is not None and spec.method == "draft_model":  # split like the target
        from openinfer.config import ModelConfig

        draft = ModelConfig.from_pretrained(spec.model)
        _check_split(draft.architecture, draft.hf_config, size, False, "the draft model's ")
    # (Every speculative method runs split: token drafters alike on every rank, a draft
    # model or MTP module split like the target, its layers reading the same parallel state.)
    _refuse_unsupported(config, f"tensor_parallel_size {size}", {
        # Two ranks' all-reduce adds two partial sums per element (exact whichever first);
        # over more ranks the order of the sums follows the tensor's size, so the batch.
        "--batch-invariant on more than 2 ranks": config.model.batch_invariant and size > 2,
        # (Overrides the multi-rank default.) With --nnodes each node's ranks lend their
        # shares from that node; Ray places ranks itself, and its ranks are not told where
        # they run yet. (The file store runs with ranks elsewhere where every node mounts
        # it: the core checks at start-up.)
        "disaggregation (--role / --kv-transfer-port)":
            _disaggregated(config) and config.distributed_executor_backend == "ray"})


def _check_split(architecture: str, hf: dict, size: int, expert_parallel: bool,
                 whose: str = "") -> None:
    """Refuse a model that ``size`` tensor-parallel ranks cannot split, naming why."""
    from openinfer.models.registry import get_model_class

    if not getattr(get_model_class(architecture), "supports_tensor_parallel", False):
        raise ValueError(f"tensor_parallel_size {size}: {whose}{architecture} cannot be split "
                         "yet (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE and "
                         "DeepSeek-V2/V3/V4 models can)")
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    sizes = [(heads, "num_attention_heads"), (hf.get("intermediate_size", 0), "intermediate_size"),
             (hf.get("o_groups", 0), "o_groups")]
    if hf.get("moe_intermediate_size") and not expert_parallel:
        sizes.append((hf["moe_intermediate_size"], "moe_intermediate_size"))
    for n, what in sizes:
        if n % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide {whose}{what} ({n})")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"tensor_parallel_size {size} and {whose}num_key_value_heads "
                         f"({kv_heads}): one must divide the other")


def check_expert_parallel(config: EngineConfig) -> None:
    """Refuse at start-up an expert-parallel split the model cannot take."""
    if not config.enable_expert_parallel:
        return
    from openinfer.models.deepseek import num_routed_experts

    experts = num_routed_experts(config.model.hf_config)
    if not experts:
        raise ValueError(f"enable_expert_parallel: {config.model.architecture} has no routed "
                         "experts (it is not a mixture-of-experts model)")
    redundant = config.eplb.num_redundant_experts if config.eplb is not None else 0
    dp = config.data_parallel
    size = dp.size if dp.size > 1 else config.tensor_parallel_size
    ranks = "the data-parallel ranks" if dp.size > 1 else "the tensor-parallel ranks"
    if redundant > experts * (size - 1):
        raise ValueError(f"eplb_config.num_redundant_experts {redundant}: at most one replica "
                         f"of an expert per rank, so at most {experts * (size - 1)} with "
                         f"{size} rank(s)")
    if (experts + redundant) % size:
        raise ValueError(f"expert parallel size {size} ({ranks}) does not divide the physical "
                         f"experts ({experts} routed + {redundant} redundant)")
    if config.eplb is not None and config.eplb.policy == "hierarchical":
        groups = config.model.hf_config.get("n_group") or 1
        nodes = config.nodes.nnodes if dp.size == 1 else 1  # (a DP group's are not known)
        per_node = (experts + redundant) // nodes
        if nodes == 1 or groups % nodes or size % nodes or experts % groups \
                or per_node > experts // nodes * (size // nodes):
            raise ValueError(f"eplb_config.policy hierarchical needs ranks on several nodes "
                             f"(--nnodes; here {nodes}) that divide the model's expert groups "
                             f"(n_group {groups}) and the {size} ranks, with at most one "
                             f"replica of an expert per rank of its node")
    if dp.size > 1:
        _refuse_unsupported(config, "data-parallel attention with expert parallelism",
                            {"--async-scheduling": config.scheduler.async_scheduling,
                             # A draft network's passes run MoE layers too: a rank drafting
                             # while another does not would break the lockstep.
                             "speculative decoding with a draft network":
                                 config.speculative is not None and config.speculative.uses_model,
                             "--batch-invariant": config.model.batch_invariant})


def _check_ranks_fit(config: EngineConfig, size: int, name: str) -> None:
    """One CUDA device per rank; on a CPU, no more ranks than cores (on this machine: Ray
    places its ranks on the cluster's nodes, and says when they do not fit)."""
    if config.distributed_executor_backend == "ray":
        return
    here = len(config.nodes.local_ranks(size))
    where = f" on each of {config.nodes.nnodes} nodes" if config.nodes.nnodes > 1 else ""
    if config.device.startswith("cuda"):
        if torch.cuda.device_count() < here:
            raise ValueError(f"{name} {size} needs {here} CUDA devices{where}; "
                             f"{torch.cuda.device_count()} visible")
    elif here > (os.cpu_count() or 1):
        raise ValueError(f"{name} {size} is {here} ranks{where}, more than CPU cores "
                         f"({os.cpu_count()})")


def _refuse_unsupported(config: EngineConfig, what: str,
                        more: dict[str, bool] | None = None) -> None:
    """The features not composed with multi-rank engines yet, refused by name."""
    unsupported = {
        "disaggregation (--role / --kv-transfer-port)": _disaggregated(config),
        **(more or {}),
    }
    for feature, on in unsupported.items():
        if on:
            raise ValueError(f"{what} does not run with {feature} yet")


def _disaggregated(config: EngineConfig) -> bool:
    return config.kv_transfer.role != "both" or config.kv_transfer.port is not None


class RankFailed(RuntimeError):
    """A rank (tensor or context parallel) died or raised: the engine cannot go on."""


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        check_tensor_parallel(config)
        check_context_parallel(config)
        self.size = config.num_ranks
        self.kind = ("context-parallel" if config.prefill_context_parallel_size > 1
                     else "tensor-parallel")
        if config.seed is None:  # unseeded sampling must draw the same on every rank
            config = replace(config, seed=random.randrange(2**31))
        local = config.nodes.local_ranks(self.size)
        remote: RemoteRanks | None = None
        if config.nodes.nnodes > 1:
            init = init_method(config.nodes)
            remote = RemoteRanks(config, range(local.stop, self.size))
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        ctx = mp.get_context("spawn")
        if mp.current_process().daemon:
            # The server's engine core is a daemonic process, and multiprocessing lets those
            # start no process. Its ranks cannot outlive it anyway (see _rank_main).
            mp.current_process().daemon = False
        self._conns: list[Connection] = []
        self._procs: list[mp.Process] = []  # this node's ranks (0..k-1)
        for rank in local:
            parent, child = ctx.Pipe()
            # Not daemonic (a daemonic rank could not be joined at exit), but killed at exit
            # by the finalizer below, and by the kernel if the core dies (die_with).
            proc = ctx.Process(target=_rank_main, name=f"openinfer-tp{rank}",
                               args=(config, rank, init, child, os.getpid(),
                                     progress and rank == 0, len(local)))
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        weakref.finalize(self, _kill_all, list(self._procs))  # also at interpreter exit
        try:
            if remote is not None:
                self._conns += self._join(remote)
            self._gather()  # each rank reports once its shard is loaded
        except BaseException:
            self._kill()
            raise
        finally:
            if remote is not None:
                remote.close()
        logger.info("%s: %d ranks (%s) on %d node(s), local worker pids %s", self.kind,
                    self.size, "NCCL" if config.device.startswith("cuda") else "gloo",
                    config.nodes.nnodes, [p.pid for p in self._procs])

    def _join(self, remote: RemoteRanks) -> list[Connection]:
        """The other nodes' connections, rank order, once all have joined; a local rank that
        fails first (it answers only after the whole group has) fails the start at once."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not remote.complete:
            if wait([*self._conns, *(p.sentinel for p in self._procs)], timeout=0.2):
                self._gather()  # raises: a local rank died or failed
            if time.monotonic() > deadline:
                raise RankFailed(f"ranks {remote.missing} did not join within "
                                 f"{JOIN_TIMEOUT_S:.0f} s: start `openinfer serve` with the "
                                 f"same parallel flags, --nnodes and --master-addr/--master-"
                                 f"port, and each node's --node-rank, on the other nodes")
        return [remote.conns[rank] for rank in sorted(remote.conns)]

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        message = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self._conns:
                conn.send_bytes(message)
        except OSError as e:  # a rank's end of the pipe is gone
            self._kill()
            raise RankFailed(f"{self.kind} rank unreachable: {e}") from e
        return self._gather()

    def _gather(self) -> list[Any]:
        """Every rank's answer to the last call, rank 0 first; a rank that died or raised
        fails it at once (and takes the others down)."""
        results: dict[int, Any] = {}
        waiting = {conn: rank for rank, conn in enumerate(self._conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while waiting:
            for ready in wait([*waiting, *sentinels]):
                rank = waiting.get(ready)
                if rank is not None:
                    try:
                        status, value = pickle.loads(ready.recv_bytes())
                    except (EOFError, OSError):
                        status, value = "died", None
                    del waiting[ready]
                else:
                    rank = sentinels.pop(ready)
                    if self._conns[rank] not in waiting or self._conns[rank].poll():
                        continue  # it answered (or its answer is still to be read)
                    status, value = "died", None
                if status == "ok":
                    results[rank] = value
                    continue
                self._kill()
                if status == "died":
                    if rank >= len(self._procs):  # its node closed the connection
                        raise RankFailed(f"{self.kind} rank {rank} (another node) died")
                    code = self._procs[rank].exitcode
                    raise RankFailed(f"{self.kind} rank {rank} died (exit code {code})")
                raise RankFailed(f"{self.kind} rank {rank} failed: {value}")
        return [results[rank] for rank in range(self.size)]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def shutdown(self) -> None:
        if not self.alive:
            self._kill()
            return
        try:
            self.collective_rpc("shutdown")
        finally:
            for proc in self._procs:
                proc.join(timeout=10)
            self._kill()

    def _kill(self) -> None:
        _kill_all(self._procs)
        for conn in self._conns[len(self._procs):]:  # other nodes' ranks end when it closes
            conn.close()


def _kill_all(procs: list[mp.Process]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=10)


def _rank_main(config: EngineConfig, rank: int, init_method: str, conn: Connection,
               core_pid: int, progress: bool, ranks_here: int) -> None:
    """A rank's process on the engine's node: it dies with the engine core."""
    die_with(core_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when we stop
    from openinfer.logger import configure_logging

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
            torch.distributed.destroy_process_group()
            return


def start_worker(config: EngineConfig, rank: int, init_method: str, progress: bool,
                 cuda_index: int, ranks_here: int | None):
    """Join the group at ``init_method`` as ``rank``, set this process's parallel state,
    and load this rank's worker (on CUDA, on device ``cuda_index``; on a CPU, this machine's
    torch threads divided among the ``ranks_here`` that share it; None: left as they are)."""
    import torch.distributed as dist

    from openinfer.distributed.context_parallel import ContextParallel, set_cp
    from openinfer.distributed.parallel_state import TensorParallel, set_tp
    from openinfer.engine.worker import Worker

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
