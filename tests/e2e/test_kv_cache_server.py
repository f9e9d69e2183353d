"""The KV cache through the real server: file-store hits across a restart, KV events in
vLLM's schema with replay, admin reset, `openinfer cache inspect`, and a conversation hitting
through the answers it was given."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import httpx
import msgpack
import openai
import pytest
import zmq
from server_process import MODEL, start_server
from test_server import _metrics

from openinfer import LLM, SamplingParams

PROMPT = list(range(100, 140))  # 40 token ids: two full blocks


def _complete(base: str, **sources: int) -> tuple[str, int]:
    """The answer's text and cached tokens; its prompt tokens by source must be ``sources``
    (the rest computed)."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    want = {"L1": 0, "L2": 0, "L3": 0, "pulled": 0, **sources}
    want["computed"] = len(PROMPT) - sum(want.values())
    assert out.usage.prompt_tokens_by_source == want
    return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens


def _replay(endpoint: str, start: int) -> list[tuple[int, dict]]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart((b"", start.to_bytes(8, "big")))
    batches = []
    while True:
        assert sock.poll(10_000), "no replay answer"
        _, seq, payload = sock.recv_multipart()
        seq = int.from_bytes(seq, "big", signed=True)
        if seq == -1:  # the end, with the number of the publisher's next batch and its epoch
            assert int.from_bytes(payload[:8], "big") == (
                batches[-1][0] + 1 if batches else start)
            assert len(payload) == 16
            break
        batches.append((seq, msgpack.unpackb(payload)))
    sock.close(linger=0)
    return batches


@pytest.mark.slow
def test_file_store_events_reset_and_restart(qwen3_checkpoint, tmp_path):
    store = tmp_path / "store"
    # Port *: the engine binds free ports and says which on GET /kv_events.
    flags = ("--kv-store-dir", str(store), "--kv-events-endpoint", "tcp://127.0.0.1:*",
             "--kv-events-replay-endpoint", "tcp://127.0.0.1:*", "--admin-api-key", "admin-key")
    base, proc = start_server(qwen3_checkpoint, *flags)
    try:
        where = json.loads(urllib.request.urlopen(f"{base}/kv_events", timeout=30).read())
        pub, replay = where["endpoint"], where["replay_endpoint"]
        assert pub.startswith("tcp://127.0.0.1:") and not pub.endswith(":*"), where
        assert replay.startswith("tcp://127.0.0.1:") and replay != pub, where
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        connected = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sub.connect(pub)
        assert connected.poll(10_000), "the subscription never reached the publisher"
        sub.disable_monitor()
        connected.close(linger=0)
        text, cached = _complete(base)
        assert cached == 0
        # The reference of every later answer (a hit from L1, then L3, then a restart's
        # files): the offline engine's, computed from scratch.
        offline = LLM(str(qwen3_checkpoint), progress=False, enable_prefix_caching=False)
        assert text == offline.generate([PROMPT], SamplingParams(
            temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0].text
        assert sub.poll(10_000)
        topic, seq, payload = sub.recv_multipart()
        batch = msgpack.unpackb(payload)
        assert topic == b"" and int.from_bytes(seq, "big") == 0
        assert set(batch) == {"ts", "events", "data_parallel_rank"}
        stored = [e for e in batch["events"] if e["type"] == "BlockStored"]
        first = stored[0]
        assert first["medium"] == "CPU" and first["block_size"] == 16
        assert first["token_ids"] == PROMPT[:16] and first["parent_block_hash"] is None
        assert len(first["block_hashes"]) == 1 and len(first["block_hashes"][0]) == 32
        assert stored[1]["medium"] == "HOST" and stored[1]["block_hashes"] == first["block_hashes"]
        sub.close(linger=0)

        # Admin reset: device and host tiers forget; the file store still holds the prefix.
        # It needs the admin key.
        for headers, status in (({}, 401), ({"Authorization": "Bearer wrong"}, 401)):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(urllib.request.Request(
                    f"{base}/v1/cache/reset", method="POST", headers=headers), timeout=30)
            assert refused.value.code == status
        reset = json.loads(urllib.request.urlopen(urllib.request.Request(
            f"{base}/v1/cache/reset", method="POST",
            headers={"Authorization": "Bearer admin-key"}), timeout=30).read())
        assert reset["reset"] and reset["device_blocks_cleared"] >= 2
        assert _complete(base, L3=32) == (text, 32)
        metrics = _metrics(base)
        assert metrics["openinfer:prefix_cache_hits_by_tier_total[L3]"] == 32
        assert _complete(base, L1=32) == (text, 32)
        assert metrics["openinfer:kv_transfer_bytes_total[store_to_host]"] > 0

        batches = _replay(replay, start=0)  # a late subscriber catches up from seq 0
        assert [seq for seq, _ in batches] == list(range(len(batches))) and len(batches) >= 2
        kinds = [e["type"] for _, b in batches for e in b["events"]]
        assert "AllBlocksCleared" in kinds and kinds.count("BlockStored") >= 4
    finally:
        proc.send_signal(signal.SIGTERM)  # graceful: pending store writes finish
        proc.wait(timeout=60)

    # `cache inspect` reads the store while a restarted server starts on it (both only read
    # it until the request below): their start-ups overlap.
    inspect = subprocess.Popen([sys.executable, "-m", "openinfer.cli", "cache", "inspect",
                                str(store)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        # A restarted server on the same directory hits yesterday's prompt from its files.
        base, proc = start_server(qwen3_checkpoint, "--kv-store-dir", str(store))
        try:
            stdout, stderr = inspect.communicate(timeout=120)
            assert inspect.returncode == 0 and " blocks, " in stdout, stderr
            assert "block_size=16" in stdout
            assert _complete(base, L3=32) == (text, 32)
        finally:
            proc.kill()
            proc.wait()
    finally:
        inspect.kill()
        inspect.wait()


def _conversation(base: str, turns: int) -> list[dict]:
    """A chat of ``turns`` requests, each resending the last one's answer as text; each turn's
    answer with its prompt's ids (``return_token_ids``) and usage."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    history = [{"role": "user", "content": "Tell me about paged attention."}]
    results = []
    for turn in range(turns):
        # Ten sampled ids of a random model: their text encodes to other ids. (Special
        # tokens it samples stay in the text, as the ids hold them.) The second turn streams.
        # /tokenize counts the turn as the engine will run it (resent answers as their ids).
        counted = httpx.post(f"{base}/tokenize", json={"messages": history}, timeout=60).json()
        request = dict(model=MODEL, messages=history, max_tokens=10, temperature=0,
                       extra_body={"ignore_eos": True, "return_token_ids": True,
                                   "skip_special_tokens": False})
        if turn == 1:
            chunks = [c.model_dump() for c in client.chat.completions.create(
                **request, stream=True, stream_options={"include_usage": True})]
            choices = [c["choices"][0] for c in chunks if c["choices"]]
            out = {"prompt_token_ids": chunks[0]["prompt_token_ids"], "usage": chunks[-1]["usage"]}
            choice = {"token_ids": [t for c in choices for t in c.get("token_ids") or ()],
                      "message": {"content": "".join(c["delta"]["content"] or ""
                                                     for c in choices)}}
        else:
            out = client.chat.completions.create(**request).model_dump()
            choice = out["choices"][0]
        results.append({"prompt": out["prompt_token_ids"], "answer": choice["token_ids"],
                        "cached": out["usage"]["prompt_tokens_details"]["cached_tokens"],
                        "counted": counted["tokens"]})
        history += [{"role": "assistant", "content": choice["message"]["content"]},
                    {"role": "user", "content": f"And after step {turn}?"}]
    return results


def test_a_conversation_hits_through_the_answers_it_was_given(qwen3_checkpoint, tokenizer):
    base, proc = start_server(qwen3_checkpoint)
    try:
        turns = _conversation(base, 3)
    finally:
        proc.kill()
        proc.wait()
    for last, turn in zip(turns, turns[1:]):
        # The next prompt leads with the last one and the ids it generated, and hits all the
        # last turn computed: its prompt and its answer but the answer's last id (which may
        # also be a character's first byte, left out of the text).
        ran = last["prompt"] + last["answer"][:-1]
        assert turn["prompt"][:len(ran)] == ran
        assert turn["cached"] == len(ran)
    assert [t["counted"] for t in turns] == [t["prompt"] for t in turns]
    # Re-encoding the answers' text instead would have missed: their ids are not the text's.
    assert any(tokenizer.encode(tokenizer.decode(t["answer"][:-1]), add_special_tokens=False)
               != t["answer"][:-1] for t in turns[:-1])
    # What a hit served is what computing it gives.
    offline = LLM(str(qwen3_checkpoint), progress=False, enable_prefix_caching=False)
    again = offline.generate([turns[-1]["prompt"]], SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0].token_ids
    assert again == turns[-1]["answer"]
