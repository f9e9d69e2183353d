"""The server's tokenizer behind the workloads' interface: same workloads as a local tokenizer,
few round trips, clear errors; and the oracle scored after the run from logged events."""

from __future__ import annotations

import json

import httpx
import pytest

from openinfer.bench.client import RequestResult, ServerError
from openinfer.bench.metrics import summarize
from openinfer.bench.report import table
from openinfer.bench.runner import SentRequest, score_oracle
from openinfer.bench.tokenizer import LocalTokenizer, ServerTokenizer
from openinfer.bench.workloads import WorkloadOptions, build_workload, vocabulary


def _tokenize_server(hf, calls: list[str]) -> httpx.MockTransport:
    """/tokenize and /detokenize as openinfer and vLLM answer them, backed by ``hf``."""

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        body = json.loads(request.content)
        if request.url.path == "/tokenize" and "messages" in body:
            text = hf.apply_chat_template(body["messages"], tokenize=False,
                                          add_generation_prompt=body["add_generation_prompt"])
            return httpx.Response(200, json={"tokens": hf.encode(text, add_special_tokens=False)})
        if request.url.path == "/tokenize":
            tokens = hf.encode(body["prompt"], add_special_tokens=body["add_special_tokens"])
            return httpx.Response(200, json={"tokens": tokens, "count": len(tokens)})
        if request.url.path == "/detokenize":
            return httpx.Response(200, json={"prompt": hf.decode(body["tokens"])})
        return httpx.Response(404, json={"detail": "Not Found"})

    return httpx.MockTransport(handle)


@pytest.fixture
def calls() -> list[str]:
    return []


@pytest.fixture
def server_tokenizer(tokenizer, calls):
    with ServerTokenizer("http://test", "tiny", transport=_tokenize_server(tokenizer, calls)) as tok:
        yield tok


def test_server_tokenizer_builds_the_workloads_a_local_one_builds(tokenizer, server_tokenizer,
                                                                   calls, tmp_path):
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": f"question {i}"},
                           {"from": "gpt", "value": "an answer " * i}]} for i in range(1, 40)]))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": 100 * i, "input_length": 40,
                                           "output_length": 3, "hash_ids": [1, i]})
                               for i in range(5)))
    local = LocalTokenizer(tokenizer)
    cases = {"random": WorkloadOptions(num_requests=300, range_ratio=0.5),
             "shared-prefix": WorkloadOptions(),
             "multi-turn": WorkloadOptions(num_users=5, num_turns=3),
             "multi-turn-shared": WorkloadOptions(num_users=5, num_turns=3,
                                                  shared_system_prompt=True),
             "agentic": WorkloadOptions(num_users=5, num_turns=3, abandon_rate=0.4),
             "sharegpt": WorkloadOptions(dataset=str(sharegpt), num_requests=50),
             "replay": WorkloadOptions(dataset=str(trace), replay_block_size=16)}
    for case, options in cases.items():
        name = case.removesuffix("-shared")
        before = len(calls)
        remote = build_workload(name, options, server_tokenizer)
        asked = len(calls) - before
        assert remote.sessions == build_workload(name, options, local).sessions, case
        assert remote.sessions == build_workload(name, options, tokenizer).sessions, case
        before = len(calls)
        build_workload(name, options, server_tokenizer)
        assert len(calls) == before, f"{case}: a rebuild is answered from the cache"
        # One probe for the vocabulary (the first case only), then one request per distinct text.
        if name in ("random", "shared-prefix", "replay"):
            assert asked <= 1, case
        elif case == "multi-turn":
            assert asked == 5 * (1 + 3), case
        elif case == "multi-turn-shared":
            assert asked == 1 + 5 * 3, case
        elif case == "agentic":  # each turn's text (its system prompt, drawn first from the
            assert asked == remote.num_turns, case  # same seed, is multi-turn-shared's)
        else:  # sharegpt: 39 distinct replies among the 50 chosen
            assert asked == 39, case
    # Multi-turn texts are decoded random tokens, about as long as asked: a 512-token system
    # prompt, then 16-token turns (re-encoding need not give back exactly as many).
    for session in build_workload("multi-turn", WorkloadOptions(input_len=16), local).sessions:
        system, *turns = local.encode([session.system, *(t.user_text for t in session.turns)])
        assert len(system) > 256 and all(8 <= len(t) <= 32 for t in turns)
    ids = vocabulary(local)
    assert len(ids) > 100 and not set(ids) & set(tokenizer.all_special_ids)


def test_server_chat_rendering_matches_the_local_template(tokenizer, server_tokenizer):
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"}]
    local = LocalTokenizer(tokenizer)
    for generation_prompt in (True, False):
        assert (server_tokenizer.render_chat([conversation], generation_prompt)
                == local.render_chat([conversation], generation_prompt))
    assert server_tokenizer.decode(server_tokenizer.encode(["plain text"])) == ["plain text"]


def test_a_server_without_tokenize_is_a_clear_error():
    transport = httpx.MockTransport(lambda request: httpx.Response(404, text="Not Found"))
    with (ServerTokenizer("http://test", "m", transport=transport) as tok,
          pytest.raises(ServerError, match="no /tokenize endpoint.*--tokenizer")):
        build_workload("random", WorkloadOptions(), tok)
    transport = httpx.MockTransport(
        lambda request: httpx.Response(400, json={"error": {"message": "model 'm' not found"}}))
    with (ServerTokenizer("http://test", "m", transport=transport) as tok,
          pytest.raises(ServerError, match="HTTP 400: model 'm' not found")):
        tok.decode([[1, 2]])


class _CharTokenizer:
    """One token per character; a chat renders as ``role:content|`` per message, plus ``a:``
    for the generation prompt."""

    name = "chars"

    def encode(self, texts):
        return [[ord(c) for c in t] for t in texts]

    def decode(self, token_lists):
        return ["".join(map(chr, ids)) for ids in token_lists]

    def render_chat(self, conversations, add_generation_prompt):
        return self.encode(["".join(f"{m['role'][0]}:{m['content']}|" for m in c)
                            + ("a:" if add_generation_prompt else "") for c in conversations])


def test_oracle_is_scored_after_the_run_from_the_logged_events():
    """Two chat users (a shared system prompt) and one completion, in this time order:
    A1 sent, B1 sent, A1 answered, A2 sent, C sent (a prompt of A1's tokens), C failed."""
    system = {"role": "system", "content": "sys"}
    a1 = [system, {"role": "user", "content": "hi"}]
    b1 = [system, {"role": "user", "content": "yo"}]
    a2 = [*a1, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    results = [RequestResult(0, t, 0.0, ok=ok, text=text) for t, ok, text in
               [(0, True, "ok"), (0, False, ""), (1, True, "fine"), (0, False, "")]]
    c_ids = [ord(c) for c in "s:sys|u:hi|xyz"]
    sent = [SentRequest(results[0], messages=a1), SentRequest(results[1], messages=b1),
            SentRequest(results[2], messages=a2), SentRequest(results[3], prompt_ids=c_ids)]
    events = [(0, False), (1, False), (0, True), (2, False), (3, False)]
    score_oracle(sent, events, _CharTokenizer())
    # A1 "s:sys|u:hi|a:" nothing cached; B1 "s:sys|u:yo|a:" shares "s:sys|u:"; A2 holds all of
    # "s:sys|u:hi|a:ok|" (A1's answered conversation); C shares "s:sys|u:hi|" with A1.
    assert [r.oracle_hit_tokens for r in results] == [0, 8, 16, 11]
    assert [r.sent_prompt_tokens for r in results[:3]] == [13, 13, 25]


def test_a_run_without_an_oracle_reports_none_not_zero():
    done = RequestResult(0, 0, 0.0, ok=True, ttft_s=0.1, e2e_s=0.2, prompt_tokens=5,
                         output_tokens=2, expected_output_tokens=2)
    summary = summarize([done], duration_s=1.0)
    assert summary["oracle_hit_rate"] is None and summary["prompt_tokens_agree"] is None
    rows = table([("run", {"summary": summary})]).splitlines()
    assert [row.split() for row in rows if row.startswith("oracle hit rate")] == [
        ["oracle", "hit", "rate", "-"]]


def test_agentic_sessions_share_the_tools_pause_for_them_and_some_stop(tokenizer):
    options = WorkloadOptions(num_users=200, num_turns=4, input_len=8, tool_time_s=0.5,
                              abandon_rate=0.25, prefix_len=64)
    workload = build_workload("agentic", options, LocalTokenizer(tokenizer))
    sessions = workload.sessions
    assert workload.endpoint == "chat" and len({s.system for s in sessions}) == 1
    assert sessions[0].system.startswith("Tools you may call:")
    lengths = [len(s.turns) for s in sessions]
    assert set(lengths) <= {1, 2, 3, 4} and 0.15 < lengths.count(4) / 200 < 0.85 + 0.1
    assert 0.1 < sum(n < 4 for n in lengths) / 200 < 0.4  # a quarter abandoned
    pauses = [t.pause_s for s in sessions for t in s.turns[1:]]
    assert all(s.turns[0].pause_s is None for s in sessions) and min(pauses) >= 0
    assert 0.4 < sum(pauses) / len(pauses) < 0.6  # exponential, mean 0.5 s
    assert all(t.user_text.startswith("Tool result:") for s in sessions for t in s.turns[1:])
    assert build_workload("agentic", options, LocalTokenizer(tokenizer)).sessions == sessions
