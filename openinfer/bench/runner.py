"""Drive a workload against a server: arrivals, sessions, closed-loop concurrency; then score
the prefix-cache oracle from what was sent and answered (no tokenization while timing)."""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from openinfer.bench import BenchError
from openinfer.bench.client import RequestResult, stream_request
from openinfer.bench.tokenizer import BenchTokenizer, as_bench_tokenizer
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


@dataclass
class SentRequest:
    """One request as sent, kept to score the oracle after the run."""

    result: RequestResult
    prompt_ids: list[int] | None = None
    """Completions: the prompt."""
    messages: list[dict] | None = None
    """Chat: the conversation sent (the answer is ``result.text``)."""


class _Sender:
    """Sends a session's turns in order and logs, in time order, each prompt sent and each
    answer received: the events the prefix-cache oracle replays after the run."""

    def __init__(self, config: RunConfig, workload: Workload, http: httpx.AsyncClient,
                 bar: tqdm | None) -> None:
        self.config, self.workload = config, workload
        self.http, self.bar = http, bar
        self.sent: list[SentRequest] = []
        """Every request, in send order."""
        self.events: list[tuple[int, bool]] = []
        """(index into ``sent``, answered): prompt sent, or prompt + answer received."""
        self.clock_zero = time.perf_counter()
        path = "/v1/chat/completions" if workload.endpoint == "chat" else "/v1/completions"
        self.url = config.base_url.rstrip("/") + path

    async def run_session(self, index: int, session: Session) -> None:
        history: list[dict] = [] if session.system is None else [
            {"role": "system", "content": session.system}]
        for t, turn in enumerate(session.turns):
            body = self._body(turn.output_len)
            result = RequestResult(index, t, 0.0, expected_output_tokens=turn.output_len)
            if self.workload.endpoint == "chat":
                history.append({"role": "user", "content": turn.user_text})
                body["messages"] = list(history)
                if self.workload.name == "agentic":  # as agent frameworks name their user
                    body["user"] = f"agent-{index}"
                sent = SentRequest(result, messages=list(history))
            else:
                body["prompt"] = turn.prompt_ids
                result.sent_prompt_tokens = len(turn.prompt_ids)
                sent = SentRequest(result, prompt_ids=turn.prompt_ids)
            sent_index = len(self.sent)
            self.events.append((sent_index, False))  # held from the moment it is prefilled
            self.sent.append(sent)
            await stream_request(self.http, self.url, body, result, self.clock_zero)
            if self.bar is not None:
                self.bar.update(1)
            if not result.ok:
                return  # later turns would build on an answer that never came
            self.events.append((sent_index, True))
            if self.workload.endpoint == "chat":
                history.append({"role": "assistant", "content": result.text})
            if t + 1 < len(session.turns):
                pause = session.turns[t + 1].pause_s
                pause = self.workload.think_time_s if pause is None else pause
                if pause:
                    await asyncio.sleep(pause)

    def _body(self, output_len: int) -> dict:
        body = {"model": self.config.model, "max_tokens": output_len, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0.0}
        if self.config.ignore_eos:
            body.update(ignore_eos=True, min_tokens=output_len)
        return body


def score_oracle(sent: list[SentRequest], events: list[tuple[int, bool]],
                 tokenizer: BenchTokenizer) -> None:
    """Fill ``oracle_hit_tokens`` (and, for chat, ``sent_prompt_tokens``) of every request.

    Replays ``events`` into a :class:`PrefixTrie` as an infinite cache would have seen them:
    a prompt is held once sent, prompt + answer once answered. Chat prompts are the rendered
    chat template; an answer is re-tokenized (completions: appended to the prompt ids; chat:
    the conversation with the answer appended, rendered without a generation prompt). All
    tokenization happens here, in a few batches, after the timed run."""
    prompts: list[list[int]] = [s.prompt_ids or [] for s in sent]
    full: dict[int, list[int]] = {}  # index -> prompt + answer
    chat = [i for i, s in enumerate(sent) if s.messages is not None]
    for i, ids in zip(chat, tokenizer.render_chat([sent[i].messages for i in chat], True)):
        prompts[i] = ids
        sent[i].result.sent_prompt_tokens = len(ids)
    done_chat = [i for i in chat if sent[i].result.ok]
    full.update(zip(done_chat, tokenizer.render_chat(
        [[*sent[i].messages, {"role": "assistant", "content": sent[i].result.text}]
         for i in done_chat], False)))
    done_completion = [i for i, s in enumerate(sent) if s.messages is None and s.result.ok]
    answers = tokenizer.encode([sent[i].result.text for i in done_completion])
    full.update((i, prompts[i] + answer) for i, answer in zip(done_completion, answers))
    trie = PrefixTrie()
    for i, answered in events:
        if answered:
            trie.insert(full[i])
        else:
            sent[i].result.oracle_hit_tokens = trie.match(prompts[i])
            trie.insert(prompts[i])


async def run_workload(config: RunConfig, workload: Workload,
                       tokenizer: BenchTokenizer | Any) -> tuple[list[RequestResult], float]:
    """Run every session; returns the per-request results (in send order) and the duration.

    ``tokenizer`` (a :class:`BenchTokenizer` or a Hugging Face tokenizer) is used only after
    the timed run, to score the oracle; if it fails then (a server tokenizer that went away),
    a warning is printed and the oracle fields stay None."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    bar = tqdm(total=workload.num_turns, desc=f"{workload.name} rate={config.request_rate}",
               disable=not config.progress, leave=False)
    async with httpx.AsyncClient(timeout=httpx.Timeout(config.timeout_s), limits=limits,
                                 headers=headers) as http:
        sender = _Sender(config, workload, http, bar)
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
    try:
        await asyncio.to_thread(score_oracle, sender.sent, sender.events,
                                as_bench_tokenizer(tokenizer))
    except BenchError as e:
        print(f"openinfer bench: no oracle hit rate for this run: {e}", file=sys.stderr)
        for s in sender.sent:
            s.result.oracle_hit_tokens = None
    return [s.result for s in sender.sent], duration


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
