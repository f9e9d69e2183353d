"""The engine-core process: an EngineCore driven by messages from a front end.

The loop never waits on a client: it drains whatever messages are queued, runs a
step when there is work, and sends that step's outputs. It blocks on its input only
when idle, waking every second to exit if its parent died (no orphan processes).
"""

from __future__ import annotations

import logging
import os
import signal
import traceback

import zmq

from openinfer.engine import protocol
from openinfer.engine.core import EngineCore
from openinfer.engine_args import create_engine_config
from openinfer.gc_heap import freeze_heap
from openinfer.logger import PeriodicStats, configure_logging
from openinfer.procs import die_with

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 1000
LOCKSTEP_POLL_MS = (5, 100)
"""A lockstep rank's idle wait between two rounds of asking the others whether any has
work (the most a request that reaches an idle group waits before its first step): the
first, doubled each idle round up to the second. Measured on 2 cores: 10 ms rounds cost
each idle rank 12% of a core."""


def run_engine_core(engine_options: dict, input_addr: str, output_addr: str,
                    parent_pid: int) -> None:
    """Process entry point: connect, load the model, report ready, serve until shutdown.
    ``parent_pid`` is the front end's pid, given by it: read here, it could already be
    init's (the front end may die while this interpreter starts)."""
    die_with(parent_pid)
    # Ctrl-C reaches the whole process group; the front end decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging()  # a spawned interpreter: the level comes from the environment
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(input_addr)
    outputs = ctx.socket(zmq.PUSH)
    outputs.connect(output_addr)
    try:
        core = EngineCore(create_engine_config(**engine_options))
        freeze_heap("engine core process")  # the model and everything built so far live on
        outputs.send(protocol.encode(protocol.READY, {
            "num_blocks": core.kv.num_blocks,
            "block_size": core.kv.block_size,
            "max_model_len": core.config.model.max_model_len,
            "compute_info": core.compute_info,
            "kv_events": core.publisher and {"endpoint": core.publisher.endpoint,
                                             "replay_endpoint": core.publisher.replay_endpoint},
        }))
        _serve(core, inputs, outputs, parent_pid)
        core.shutdown()  # finish file-store writes: a restarted server finds them
    except Exception as e:  # report, so the front end fails requests instead of hanging
        logger.error("engine core failed: %s", traceback.format_exc())
        outputs.send(protocol.encode(protocol.ERROR, f"{type(e).__name__}: {e}"))
    finally:
        outputs.close(linger=1000)
        inputs.close(linger=0)
        ctx.term()


def _serve(core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket, parent_pid: int) -> None:
    periodic = PeriodicStats()
    idle_ms = IDLE_POLL_MS
    while True:
        busy = core.has_unfinished_requests()
        if core.lockstep:  # every rank steps when any has work (engine/core.py)
            busy = core.any_rank_busy()
            first, most = LOCKSTEP_POLL_MS
            idle_ms = first if busy else min(most, 2 * idle_ms)
        if not busy:
            periodic.idle()
        if not busy and not inputs.poll(idle_ms):
            if os.getppid() != parent_pid:
                return  # the front end is gone
            if core.connector.collect_leases():  # KV pulled or abandoned is freed even when idle
                outputs.send(protocol.encode(protocol.OUTPUTS, {"outputs": [],
                                                                "stats": core.stats()}))
            continue
        while inputs.poll(0):
            kind, body = protocol.decode(inputs.recv())
            if kind == protocol.SHUTDOWN:
                return
            if kind == protocol.ADD:
                core.add_request(body["request_id"], body["prompt_token_ids"],
                                 protocol.params_from_body(body), body["arrival_time"])
            elif kind == protocol.ABORT:
                core.abort_requests(body)
            elif kind == protocol.UTILITY:
                outputs.send(protocol.encode(protocol.UTILITY_RESULT, _call(core, body)))
        # In lockstep a rank steps exactly when the others do: on a busy answer, even with
        # nothing of its own; after an idle one, requests that just arrived wait for the
        # next round (one all-reduce away).
        step = busy if core.lockstep else core.has_unfinished_requests() or busy
        if step:
            run = core.lockstep or core.has_unfinished_requests()
            step_outputs = core.step() if run else []
            stats = core.stats()
            outputs.send(protocol.encode(protocol.OUTPUTS, {
                "outputs": [protocol.pack_output(o) for o in step_outputs],
                "stats": stats,
            }))
            periodic.record(sum(len(o.new_token_ids) for o in step_outputs), stats)


UTILITY_METHODS = {"reset_prefix_cache": EngineCore.reset_prefix_cache, "stats": EngineCore.stats,
                   "pin_tokens": EngineCore.pin_tokens}


def _call(core: EngineCore, body: dict) -> dict:
    """Run an admin call from the front end between steps."""
    method = UTILITY_METHODS.get(body["method"])
    if method is None:
        return {"call_id": body["call_id"], "error": f"unknown method {body['method']!r}"}
    try:
        return {"call_id": body["call_id"], "result": method(core, *body.get("args", ()))}
    except Exception as e:  # an admin call must not take the engine down
        return {"call_id": body["call_id"], "error": f"{type(e).__name__}: {e}"}
