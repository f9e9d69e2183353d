"""The prefill leg of a disaggregated request (`openinfer router --prefill ... --decode ...`).

The router has already chosen the decode instance by its policy, so that instance's own
prefix cache counts. If the part of the prompt it lacks is at least --disagg-min-tokens
long, a prefill instance (chosen by the same policy over the prefill pool) computes the
prompt first: it gets the request with max_tokens 1, not streamed, and
kv_transfer_params {"do_remote_decode": true}, and answers with the kv_transfer_params
that say where its blocks wait. Those go with the client's request to the decode
instance, which pulls the blocks it lacks and decodes, streaming to the client.

Whatever fails on the prefill leg (no prefill instance, a dead one, an error answer)
sends the request to decode unchanged: it recomputes, and the client only sees a
slower first token. A request whose decode leg never starts (the client left between
the legs, or no decode instance answered) releases its lease at once: the prefill
instance frees the blocks instead of holding them to --kv-lease-timeout. A client that
leaves during the prefill leg itself does not cut the leg short: closing the connection
would abort a prefill still running, but one that has just finished holds a lease nobody
would hear of. The leg runs to its end in the background, and its lease is released.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from dataclasses import dataclass

import httpx
from prometheus_client import Counter

from openinfer.kv.remote import KVTransferParams
from openinfer.router.policies import Decision, Router, Worker
from openinfer.router.upstream import ReplicaEjected, unless_ejected
from openinfer.transfer.connector import release_lease
from openinfer.transfer.protocol import KVTransferError

logger = logging.getLogger(__name__)
ORPHANED_LEG_S = 600.0
"""How long a prefill leg whose client left is waited on for the lease it returns."""
_orphaned: set[asyncio.Task] = set()  # (held: the event loop keeps only weak references)


@dataclass(frozen=True)
class PrefillLeg:
    """What the prefill leg needs of the router. The router's state owns one when it has
    prefill instances, and this module never needs the router app's types."""

    pool: Router
    """The prefill instances, chosen by the router's policy."""
    http: httpx.AsyncClient
    """The router's client (its connection pool)."""
    block_size: int
    """The replicas' KV block size: how many tokens a matched block saves."""
    min_tokens: int
    """--disagg-min-tokens: shorter uncached prompts go straight to decode."""
    kv_transfer_secret: str | None
    """The replicas' --kv-transfer-secret, to release a lease nobody will pull."""
    decisions: Counter
    """openinfer_router:disagg_decisions, labelled by ``decision``."""
    leases_released: Counter
    """openinfer_router:disagg_leases_released."""


async def prefill_first(leg: PrefillLeg, path: str, body: dict, raw: bytes,
                        headers: dict, num_tokens: int, hashes: list[bytes],
                        decode: Decision) -> tuple[bytes, str, dict | None]:
    """The body to send the decode instance, the prefill instance used ("none"), and the
    kv_transfer_params of the lease it holds (None)."""
    uncached = num_tokens - decode.matched_blocks * leg.block_size
    # n > 1 samples would race for one lease: those, and short or mostly cached prompts,
    # go straight to decode.
    if body.get("n", 1) != 1 or uncached < leg.min_tokens:
        leg.decisions.labels(decision="decode_only").inc()
        return raw, "none", None
    choice = leg.pool.choose(hashes)
    params = None
    if choice is not None:
        worker = choice.worker
        prefill_body = {**body, "max_tokens": 1, "stream": False,
                        "kv_transfer_params": {"do_remote_decode": True}}
        prefill_body.pop("stream_options", None)
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        worker.in_flight += 1
        answer = asyncio.ensure_future(leg.http.post(
            worker.url + path, json=prefill_body, headers=worker.forwarded_headers(headers)))
        orphaned = False
        try:
            resp = await unless_ejected(worker, asyncio.shield(answer))
            if resp.status_code == 200:
                params = resp.json().get("kv_transfer_params")
            else:
                logger.warning("prefill %s answered %d: %s", worker.url, resp.status_code,
                               resp.text[:200])
        except asyncio.CancelledError:  # the client left: the leg ends in the background
            orphaned = True
            leg.decisions.labels(decision="client_left").inc()
            task = asyncio.create_task(_release_when_answered(leg, worker, answer))
            _orphaned.add(task)
            task.add_done_callback(_orphaned.discard)
            raise
        except (httpx.HTTPError, OSError, ValueError, ReplicaEjected) as e:
            answer.cancel()
            if isinstance(e, httpx.TransportError | ReplicaEjected):
                worker.healthy = False  # the health loop re-admits it when it answers
            logger.warning("prefill %s failed (%s); decode recomputes", worker.url, e)
        finally:
            if not orphaned:  # (an orphaned leg counts until it ends)
                worker.in_flight -= 1
        worker.routed += 1
    if not params:
        leg.decisions.labels(decision="prefill_failed").inc()
        return raw, "none", None
    leg.decisions.labels(decision="prefill_then_decode").inc()
    return json.dumps({**body, "kv_transfer_params": params}).encode(), choice.worker.url, params


async def _release_when_answered(leg: PrefillLeg, worker: Worker,
                                  answer: asyncio.Future) -> None:
    """Wait for the prefill leg of a client that left, and release the lease it returns."""
    params = None
    try:
        async with asyncio.timeout(ORPHANED_LEG_S):
            resp = await unless_ejected(worker, asyncio.shield(answer))
        if resp.status_code == 200:
            params = resp.json().get("kv_transfer_params")
    except (TimeoutError, httpx.HTTPError, OSError, ValueError, ReplicaEjected) as e:
        answer.cancel()
        logger.warning("prefill %s of a request whose client left: %s", worker.url, e)
    finally:
        worker.in_flight -= 1
    if params:
        release_unused_lease(leg, params)


def release_unused_lease(leg: PrefillLeg, params: dict) -> None:
    """Tell the prefill instance that no decode instance will pull this lease. In a thread:
    the caller may be a handler being cancelled, which can no longer await."""
    def release() -> None:
        try:
            release_lease(KVTransferParams.parse(params), leg.kv_transfer_secret, 5.0)
            leg.leases_released.inc()
        except (OSError, KVTransferError, ValueError) as e:  # it expires in its own time
            logger.warning("could not release KV lease at %s:%s: %s",
                           params.get("remote_host"), params.get("remote_port"), e)

    threading.Thread(target=release, name="openinfer-release-lease", daemon=True).start()
