"""Prompt caching through the real server: Anthropic's ``cache_control`` breakpoints pin the
prompt up to them, usage counts what was read and written exactly, caps per API key and in all
hold, OpenAI's ``prompt_cache_retention`` is taken, and a session pinned to a replica that is
lost goes on, from the file store, on another."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import httpx
import pytest
from server_process import MODEL, start_router, start_server, start_servers, stop

BLOCK_BYTES = 16 * 2 * 2 * 2 * 16 * 4  # the test checkpoint's 16-token block (K and V, fp32)
KEYS = ("key-a", "key-b")
SYSTEM = " ".join(f"Rule {i}: answer briefly and cite the page." for i in range(12))
QUESTION = "Which pages of the manual describe the paged attention kernel and its tests?"


def _post(base: str, path: str, body: dict, key: str = KEYS[0]) -> tuple[int, dict | str]:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw = resp.read().decode()
            return resp.status, raw if body.get("stream") else json.loads(raw)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _message(system_ttl: str | None = "1h", question_ttl: str | None = "5m",
             question: str = QUESTION, **extra) -> dict:
    def block(text: str, ttl: str | None) -> dict:
        return {"type": "text", "text": text,
                **({"cache_control": {"type": "ephemeral", "ttl": ttl}} if ttl else {})}
    return {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "system": [block(SYSTEM, system_ttl)],
            "messages": [{"role": "user", "content": [block(question, question_ttl)]}], **extra}


def _blocks_before(tokenizer, question: str, text: str) -> int:
    """Tokens of the rendered prompt up to the end of ``text``, in whole blocks: a hand count
    (the template's text, cut where that block's text ends, encoded)."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        tokenize=False, add_generation_prompt=True)
    end = rendered.index(text) + len(text)
    return len(tokenizer.encode(rendered[:end], add_special_tokens=False)) // 16 * 16


@pytest.fixture(scope="module")
def server(qwen3_checkpoint):
    base, proc = start_server(qwen3_checkpoint, "--api-key", *KEYS, "--kv-pin-memory",
                              str(48 * BLOCK_BYTES), "--kv-pin-memory-per-key",
                              str(24 * BLOCK_BYTES))
    yield base
    proc.kill()
    proc.wait()


def test_breakpoints_pin_and_usage_counts_reads_and_writes(server, tokenizer):
    system_end = _blocks_before(tokenizer, QUESTION, SYSTEM)
    question_end = _blocks_before(tokenizer, QUESTION, QUESTION)
    assert 0 < system_end < question_end
    code, first = _post(server, "/v1/messages", _message())
    assert code == 200, first
    usage = first["usage"]
    prompt = usage["input_tokens"] + usage["cache_creation_input_tokens"]
    assert usage == {
        "input_tokens": prompt - question_end, "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": question_end,
        "cache_creation": {"ephemeral_1h_input_tokens": system_end,
                           "ephemeral_5m_input_tokens": question_end - system_end},
        "output_tokens": 4, "prompt_tokens_by_source": usage["prompt_tokens_by_source"]}
    # The same prompt again reads what it can (all whole blocks but the one its last token
    # is in) and writes nothing; streamed, message_start says the same.
    read = (prompt - 1) // 16 * 16
    code, again = _post(server, "/v1/messages", _message())
    assert again["usage"]["cache_read_input_tokens"] == read
    assert again["usage"]["cache_creation_input_tokens"] == 0
    assert again["usage"]["input_tokens"] == prompt - read
    code, stream = _post(server, "/v1/messages", _message(stream=True))
    start = json.loads(stream.split("event: message_start\ndata: ")[1].split("\n")[0])
    assert start["message"]["usage"]["cache_read_input_tokens"] == read
    assert start["message"]["usage"]["cache_creation"] == {
        "ephemeral_1h_input_tokens": 0, "ephemeral_5m_input_tokens": 0}


def test_a_key_past_its_cap_is_served_unpinned_and_others_still_pin(server, tokenizer):
    # Key b: 24 blocks of its own at most. A question that takes it past them is served,
    # and its usage writes nothing; key a's pins stand, and it may still pin another.
    long = " ".join(f"Question {i} about the kernel's tests?" for i in range(8))
    code, refused = _post(server, "/v1/messages", _message(None, "1h", long), KEYS[1])
    assert code == 200, refused
    assert _blocks_before(tokenizer, long, long) > 24 * 16
    usage = refused["usage"]
    assert usage["cache_creation_input_tokens"] == 0
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == (
        sum(usage["prompt_tokens_by_source"].values()))
    other = "Which test covers the kernel's sliding-window masks?"
    code, taken = _post(server, "/v1/messages", _message(None, "5m", other), KEYS[1])
    assert taken["usage"]["cache_creation"]["ephemeral_5m_input_tokens"] > 0


@pytest.mark.parametrize("change,param", [
    ({"system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral",
                                                                 "ttl": "2h"}}]},
     "system.0.cache_control"),
    ({"system": [{"type": "text", "text": "x", "cache_control": {"type": "persistent"}}]},
     "system.0.cache_control"),
    ({"system": [{"type": "text", "text": str(i), "cache_control": {"type": "ephemeral"}}
                 for i in range(5)]}, "system.4.cache_control"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {},
         "cache_control": {"type": "ephemeral"}}]}, {"role": "user", "content": "ok"}]},
     "messages.1.content.0.cache_control"),
])
def test_a_breakpoint_that_cannot_be_honoured_is_refused_by_name(server, change, param):
    code, body = _post(server, "/v1/messages", {**_message(), **change})
    assert code == 400 and body["error"]["message"].startswith(param + ":"), body


def test_prompt_cache_retention_pins_the_prompt_for_a_day(server):
    body = {"model": MODEL, "prompt": QUESTION * 3, "max_tokens": 2,
            "prompt_cache_retention": "24h"}
    code, out = _post(server, "/v1/completions", body)
    assert code == 200, out
    code, out = _post(server, "/v1/completions", {**body, "prompt_cache_retention": "7d"})
    assert code == 400 and out["error"]["param"] == "prompt_cache_retention", out


def test_a_session_whose_replica_is_lost_goes_on_from_the_shared_store(qwen3_checkpoint,
                                                                      tmp_path):
    """Two replicas over one file store behind the router: a session's pinned prompt is
    written there; its replica is killed; the session's next request is served by the other,
    which reads the pinned blocks from the store (nothing lost, nothing recomputed)."""
    store = tmp_path / "store"
    (a, proc_a), (b, proc_b) = start_servers(*[(qwen3_checkpoint, "--kv-store-dir", str(store))] * 2)
    router, router_proc = start_router([a, b], qwen3_checkpoint, "--policy", "cache_aware")
    prompt = list(range(100, 170))  # 4 whole blocks, then 6 tokens
    session = {"x-session-id": "agent-7"}

    def complete(base: str, tokens: list[int]) -> httpx.Response:
        resp = httpx.post(f"{base}/v1/completions", headers=session, timeout=120, json={
            "model": MODEL, "prompt": tokens, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "prompt_cache_retention": "24h"})
        assert resp.status_code == 200, resp.text
        return resp
    try:
        first = complete(router, prompt)
        served, other = first.headers["x-openinfer-worker"], {a: b, b: a}
        dead = proc_a if served == a else proc_b
        deadline = time.monotonic() + 30
        while len(list(store.rglob("*.kvblock"))) < 4:  # written through to the shared store
            assert time.monotonic() < deadline
            complete(served, [7, 8, 9])  # (a step: the last blocks' copies run at its start)
        dead.kill()
        dead.wait()
        again = complete(router, prompt + [5, 6, 7])
        assert again.headers["x-openinfer-worker"] == other[served]
        sources = again.json()["usage"]["prompt_tokens_by_source"]
        assert sources["L3"] == 64 and sources["computed"] == 73 - 64
        assert again.json()["choices"][0]["text"] == complete(other[served], prompt + [
            5, 6, 7]).json()["choices"][0]["text"]
    finally:
        stop(router_proc)
        for proc in (proc_a, proc_b):
            proc.kill()
            proc.wait()
