"""Drive a workload against a server: arrivals, sessions, closed-loop concurrency."""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from openinfer.bench.client import RequestResult, stream_request
from openinfer.bench.workloads import Session, Workload


@dataclass(frozen=True)
class RunConfig:
    base_url: str
    model: str
    request_rate: float = math.inf
    """Sessions started per second; inf starts them all at once."""
    arrival: str = "poisson"
    """poisson or fixed spacing at request_rate."""
    concurrency: int | None = None
    """Most sessions in flight at once (closed loop); None for no limit."""
    ignore_eos: bool = True
    """Send ignore_eos/min_tokens so each request makes exactly its output length."""
    api_key: str | None = None
    timeout_s: float = 600.0
    seed: int = 0
    progress: bool = True


class PrefixTrie:
    """Every token sequence an infinite prefix cache would hold (a radix tree).

    ``match(seq)`` is how many leading tokens of seq it holds: the oracle cache hit."""

    def __init__(self) -> None:
        self._root: dict[int, list] = {}  # first token -> [edge tokens, child node]

    def insert(self, seq: list[int]) -> None:
        node, i = self._root, 0
        while i < len(seq):
            entry = node.get(seq[i])
            if entry is None:
                node[seq[i]] = [list(seq[i:]), {}]
                return
            edge = entry[0]
            n = _common_prefix(edge, seq, i)
            if n < len(edge):  # split the edge where seq leaves it
                entry[0], entry[1] = edge[:n], {edge[n]: [edge[n:], entry[1]]}
            i += n
            node = entry[1]

    def match(self, seq: list[int]) -> int:
        node, i = self._root, 0
        while i < len(seq):
            entry = node.get(seq[i])
            if entry is None:
                break
            n = _common_prefix(entry[0], seq, i)
            i += n
            if n < len(entry[0]):
                break
            node = entry[1]
        return i


def _common_prefix(edge: list[int], seq: list[int], start: int) -> int:
    n = 0
    while n < len(edge) and start + n < len(seq) and edge[n] == seq[start + n]:
        n += 1
    return n


class _Sender:
    """Sends a session's turns in order, keeping the oracle's view of the cache."""

    def __init__(self, config: RunConfig, workload: Workload, tokenizer,
                 http: httpx.AsyncClient, bar: tqdm | None) -> None:
        self.config, self.workload, self.tokenizer = config, workload, tokenizer
        self.http, self.bar = http, bar
        self.trie = PrefixTrie()
        self.results: list[RequestResult] = []
        self.clock_zero = time.perf_counter()
        path = "/v1/chat/completions" if workload.endpoint == "chat" else "/v1/completions"
        self.url = config.base_url.rstrip("/") + path

    async def run_session(self, index: int, session: Session) -> None:
        history: list[dict] = [] if session.system is None else [
            {"role": "system", "content": session.system}]
        for t, turn in enumerate(session.turns):
            body = self._body(turn.output_len)
            if self.workload.endpoint == "chat":
                history.append({"role": "user", "content": turn.user_text})
                body["messages"] = list(history)
                prompt_ids = self._chat_ids(history, add_generation_prompt=True)
            else:
                body["prompt"] = turn.prompt_ids
                prompt_ids = turn.prompt_ids
            result = RequestResult(index, t, 0.0, expected_output_tokens=turn.output_len,
                                   sent_prompt_tokens=len(prompt_ids),
                                   oracle_hit_tokens=self.trie.match(prompt_ids))
            self.trie.insert(prompt_ids)  # held from the moment it is prefilled
            self.results.append(result)
            await stream_request(self.http, self.url, body, result, self.clock_zero)
            if self.bar is not None:
                self.bar.update(1)
            if not result.ok:
                return  # later turns would build on an answer that never came
            if self.workload.endpoint == "chat":
                history.append({"role": "assistant", "content": result.text})
                self.trie.insert(self._chat_ids(history, add_generation_prompt=False))
            else:
                self.trie.insert(prompt_ids + self.tokenizer.encode(result.text,
                                                                    add_special_tokens=False))
            if t + 1 < len(session.turns) and self.workload.think_time_s:
                await asyncio.sleep(self.workload.think_time_s)

    def _body(self, output_len: int) -> dict:
        body = {"model": self.config.model, "max_tokens": output_len, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0.0}
        if self.config.ignore_eos:
            body.update(ignore_eos=True, min_tokens=output_len)
        return body

    def _chat_ids(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)


async def run_workload(config: RunConfig, workload: Workload,
                       tokenizer) -> tuple[list[RequestResult], float]:
    """Run every session; returns the per-request results (in send order) and the duration."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    bar = tqdm(total=workload.num_turns, desc=f"{workload.name} rate={config.request_rate}",
               disable=not config.progress, leave=False)
    async with httpx.AsyncClient(timeout=httpx.Timeout(config.timeout_s), limits=limits,
                                 headers=headers) as http:
        sender = _Sender(config, workload, tokenizer, http, bar)
        gate = asyncio.Semaphore(config.concurrency) if config.concurrency else None

        async def start(index: int, session: Session, at: float) -> None:
            delay = at - (time.perf_counter() - sender.clock_zero)
            if delay > 0:
                await asyncio.sleep(delay)
            if gate is None:
                await sender.run_session(index, session)
                return
            async with gate:
                await sender.run_session(index, session)

        arrivals = _arrival_times(workload.sessions, config)
        await asyncio.gather(*(start(i, s, at) for i, (s, at) in
                               enumerate(zip(workload.sessions, arrivals))))
        duration = time.perf_counter() - sender.clock_zero
    bar.close()
    return sender.results, duration


def _arrival_times(sessions: list[Session], config: RunConfig) -> list[float]:
    if all(s.arrival_s is not None for s in sessions):  # a replayed trace keeps its clock
        return [s.arrival_s for s in sessions]
    if math.isinf(config.request_rate):
        return [0.0] * len(sessions)
    rng = random.Random(config.seed)
    times, now = [], 0.0
    for _ in sessions:
        times.append(now)
        gap = 1.0 / config.request_rate
        now += rng.expovariate(config.request_rate) if config.arrival == "poisson" else gap
    return times
