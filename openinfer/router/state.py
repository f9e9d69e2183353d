"""The router's state: its replicas (serving and, when disaggregated, prefill), their health
and KV-event loops, its metrics, and how a request's prompt is hashed.

Replicas are health-checked every second (ejected on failure, re-admitted when they answer
again), and their KV events, when they publish them, keep the cache index exact. A
request's prompt is hashed exactly as the engines hash it: the server's own prompt renderer
(server/prompt.py), over the same tokenizer and chat template, then the same hash chain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics

from openinfer.kv.block_hash import extend_block_hashes
from openinfer.router.kv_events import EventFollower
from openinfer.router.metrics import replica_load
from openinfer.router.pd import PrefillLeg
from openinfer.router.policies import Decision, Router, RouterConfig, Worker
from openinfer.server.anthropic_protocol import MessagesRequest, openai_tools
from openinfer.server.limits import tenant_salt, within_tenant
from openinfer.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from openinfer.server.prompt import PromptRenderer
from openinfer.server.responses_protocol import ResponsesRequest

disable_created_metrics()  # no *_created series (see server/metrics.py)

logger = logging.getLogger(__name__)
HEALTH_INTERVAL_S = 1.0


class RouterState:
    def __init__(self, urls: list[str], config: RouterConfig, renderer: PromptRenderer,
                 block_size: int,
                 prefill_urls: list[str] = (), disagg_min_tokens: int = 256,
                 cache_salt_per_api_key: bool = False,
                 kv_transfer_secret: str | None = None) -> None:
        self.router = Router(config, [Worker(u.rstrip("/")) for u in urls])
        """The replicas that answer clients (decode instances, when disaggregated)."""
        self.prefill = Router(config, [Worker(u.rstrip("/")) for u in prefill_urls]) \
            if prefill_urls else None
        """Disaggregation: the prefill instances, chosen by the same policy."""
        self.cache_salt_per_api_key = cache_salt_per_api_key
        """The replicas salt each request's prefix cache by its API key: hash as they do."""
        self.renderer = renderer
        """The server's prompt renderer, over the replicas' tokenizer and chat template."""
        self.block_size = block_size
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                      limits=httpx.Limits(max_connections=None,
                                                          max_keepalive_connections=None))
        self.zmq = zmq.asyncio.Context()
        # The replicas' --kv-transfer-secret: their KV events speak CURVE, keyed by it, and
        # the prefill leg gives it when it releases a lease nobody will pull.
        self.events = EventFollower(self.http, self.zmq, kv_transfer_secret)
        self._tasks: dict[str, list[asyncio.Task]] = {}
        self.engine_index = {w.url: i for i, w in enumerate(self.all_workers)}
        """Each replica's number, its `engine` label in /metrics: serving replicas, prefill
        instances, then those added at run time (a URL keeps its number)."""
        disagg, leases_released = self._register_metrics()
        self.prefill_leg = PrefillLeg(self.prefill, self.http, block_size, disagg_min_tokens,
                                      kv_transfer_secret, disagg, leases_released) \
            if self.prefill is not None else None
        """Disaggregation: what the prefill leg of a request needs (router/pd.py)."""

    def _register_metrics(self) -> tuple[Counter, Counter]:
        """The router's own series (in ``self.registry``); returns the disaggregation
        counters, which its prefill leg keeps."""
        r = self.registry = CollectorRegistry()
        self.decisions = Counter("openinfer_router:decisions", "Routing decisions by reason",
                                 ["reason"], registry=r)
        self.prompt_blocks = Counter("openinfer_router:prompt_blocks",
                                     "Full prompt blocks of routed requests", registry=r)
        self.matched_blocks = Counter("openinfer_router:matched_blocks",
                                      "Of those, blocks the chosen replica already held",
                                      registry=r)
        self.load = Gauge("openinfer_router:worker_in_flight", "Requests in flight per replica",
                          ["worker"], registry=r)
        self.external_load = Gauge("openinfer_router:worker_external_load",
                                   "Requests a replica reported beyond those routed here",
                                   ["worker"], registry=r)
        self.healthy_gauge = Gauge("openinfer_router:worker_healthy", "1 if in rotation",
                                   ["worker"], registry=r)
        self.max_excess = Gauge("openinfer_router:max_load_excess",
                                "Most requests a chosen replica had in flight beyond the least "
                                "loaded one, at the moment of a routing decision", registry=r)
        self.max_excess_seen = 0
        disagg = Counter("openinfer_router:disagg_decisions",
                         "Disaggregation per request: prefill_then_decode, decode_only "
                         "(short or cached prompt), prefill_failed (decode recomputed), "
                         "client_left (during the prefill leg, whose lease is then "
                         "released)",
                         ["decision"], registry=r)
        leases_released = Counter(
            "openinfer_router:disagg_leases_released",
            "Prefill leases released by the router because their decode leg never started "
            "(the client left during or between the legs, or no decode instance answered)",
            registry=r)
        self.routed = Counter("openinfer_router:worker_requests", "Requests routed per replica",
                              ["worker"], registry=r)
        self.rerouted = Counter("openinfer_router:rerouted_requests",
                                "Requests sent to another replica because this one failed, "
                                "was ejected or answered 503 before answering", ["worker"], registry=r)
        return disagg, leases_released

    # ---- replicas --------------------------------------------------------------------

    def add_worker(self, url: str) -> Worker:
        url = url.rstrip("/")
        worker = next((w for w in self.router.workers if w.url == url), None)
        if worker is None:
            # Never handed a client's credentials; in rotation once its /health answers.
            worker = Worker(url, trusted=False, healthy=False)
            self.engine_index.setdefault(url, len(self.engine_index))
            self.router.workers.append(worker)
            self._start_watch(worker)
        return worker

    def remove_worker(self, url: str) -> bool:
        url = url.rstrip("/")
        worker = next((w for w in self.router.workers if w.url == url), None)
        if worker is None:
            return False
        self.router.workers.remove(worker)
        for task in self._tasks.pop(url, []):
            task.cancel()
        return True

    def start(self) -> None:
        for worker in self.all_workers:
            self._start_watch(worker)

    @property
    def all_workers(self) -> list[Worker]:
        return self.router.workers + (self.prefill.workers if self.prefill else [])

    def _start_watch(self, worker: Worker) -> None:
        self._tasks[worker.url] = [asyncio.create_task(self._health_loop(worker)),
                                   asyncio.create_task(self.events.follow(worker))]

    async def _follow_events_again(self, worker: Worker) -> None:
        """A replica back in rotation may be a new process (its event endpoints new, its
        cache empty): subscribe afresh, and wait (a few seconds at most) until the index
        has caught up or started over."""
        tasks = self._tasks[worker.url]
        tasks[1].cancel()
        await asyncio.wait({tasks[1]})
        synced = asyncio.Event()
        tasks[1] = asyncio.create_task(self.events.follow(worker, synced))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await synced.wait()

    async def close(self) -> None:
        for tasks in self._tasks.values():
            for task in tasks:
                task.cancel()
        await self.http.aclose()
        self.zmq.term()

    async def _health_loop(self, worker: Worker) -> None:
        while True:
            try:
                resp = await self.http.get(f"{worker.url}/health", timeout=2.0)
                healthy = resp.status_code == 200
                if healthy:
                    await self._poll_load(worker)
            except (httpx.HTTPError, OSError):
                healthy = False
            if healthy and not worker.healthy:
                await self._follow_events_again(worker)  # (before it is routed to again)
            if healthy != worker.healthy:
                logger.warning("replica %s %s", worker.url, "re-admitted" if healthy else "ejected")
            worker.healthy = healthy
            self.healthy_gauge.labels(worker=worker.url).set(1 if healthy else 0)
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def _poll_load(self, worker: Worker) -> None:
        """The replica's own view of its load, from its Prometheus metrics."""
        in_flight = worker.in_flight  # what we had sent it when it answered
        resp = await self.http.get(f"{worker.url}/metrics", timeout=2.0)
        requests, worker.kv_usage = replica_load(resp.text)  # whatever its --metrics-prefix
        worker.report(requests, in_flight)

    # ---- requests --------------------------------------------------------------------

    def prompt_hashes(self, path: str, body: dict, api_key: str) -> tuple[int, list[bytes]]:
        """The request's prompt length and full blocks, hashed as its engine will hash them
        (salted by ``api_key`` when the replicas salt by it)."""
        try:
            ids = prompt_ids(self.renderer, path, body)
        except Exception:
            return 0, []  # the replica will explain what is wrong with it
        salt = body.get("cache_salt")
        if self.cache_salt_per_api_key:
            salt = within_tenant(tenant_salt(api_key), salt)
        hashes: list[bytes] = []
        extend_block_hashes(hashes, ids, self.block_size, salt)
        return len(ids), hashes

    def note_load_excess(self, worker: Worker) -> None:
        """Keep openinfer_router:max_load_excess: how many requests the replica just chosen
        has in flight beyond the least loaded one."""
        excess = worker.load - min(w.load for w in self.router.healthy())
        if excess > self.max_excess_seen:
            self.max_excess_seen = excess
            self.max_excess.set(excess)

    def count_routed(self, decision: Decision, hashes: list[bytes]) -> None:
        """Count a request whose replica has started answering it."""
        worker = decision.worker
        self.decisions.labels(reason=decision.reason).inc()
        self.prompt_blocks.inc(len(hashes))
        self.matched_blocks.inc(decision.matched_blocks)
        self.routed.labels(worker=worker.url).inc()
        worker.routed += 1


def prompt_ids(renderer: PromptRenderer, path: str, body: dict) -> list[int]:
    """The token ids a replica's engine will run for the request's (first) prompt.

    The body is read by the server's own request models and rendered by the server's
    renderer, so defaults, template arguments and content blocks are the same as there;
    the engine then keeps the last ``truncate_prompt_tokens`` tokens, and so does this.
    Raises whatever the server would answer with a 400.
    """
    limit = None
    if path == "/v1/completions":
        completion = CompletionRequest.model_validate(body)
        prompts = renderer.completion(completion.prompt, completion.add_special_tokens)
        ids, limit = prompts[0].token_ids, completion.truncate_prompt_tokens
    elif path == "/v1/chat/completions":
        chat = ChatCompletionRequest.model_validate(body)
        # The server shows the template the tools unless tool_choice is "none".
        tools = chat.tools if chat.tool_choice != "none" else None
        ids, limit = renderer.openai_chat(chat, tools=tools), chat.truncate_prompt_tokens
    elif path == "/v1/messages":
        messages = MessagesRequest.model_validate(body)
        none = (messages.tool_choice or {}).get("type") == "none"
        ids = renderer.anthropic_messages(
            messages, tools=None if none else openai_tools(messages) or None)
    elif path == "/v1/responses":  # its own input (earlier turns are in a replica's store)
        responses = ResponsesRequest.model_validate(body)
        chat = responses.chat_request(responses.input_items(), 0)
        tools = chat.tools if chat.tool_choice != "none" else None
        ids = renderer.openai_chat(chat, tools=tools)
    else:
        raise ValueError(f"no prompt on {path}")
    if limit is not None and limit >= 1:  # -1 depends on max_model_len: not known here
        ids = ids[-limit:]
    return ids
