"""The router hashes each prompt as the engine runs it: for a chat request whose template
arguments change the text, an Anthropic request with a system prompt and a completion of
token ids, the block hashes the router routed on (its x-openinfer-prefix-* headers) are the
ones the engine announced in its own BlockStored events, with prefix caches salted per
API key (another key's same prompt has other blocks). One server, one router."""

from __future__ import annotations

import json
import time
import urllib.request

import httpx
import msgpack
import pytest
import zmq
from server_process import MODEL, admin_workers, start_router, start_server, stop

from openinfer.kv.events import secure_subscriber

# A chat format of the server's own (--chat-template), not the checkpoint's, led by a system
# line only when the `persona` template argument is given. Content must be a string: the
# server reduces Anthropic content blocks to their text.
TEMPLATE = (
    "{%- if persona is defined %}"
    "{{- '<|im_start|>system | You are ' + persona + '.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m['role'] + ' | ' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant | ' }}{%- endif %}"
)
BLOCK_SIZE = 16
QUESTION = [{"role": "user", "content": "Explain in detail how a paged KV cache shares the "
                                        "blocks of a common prompt prefix between requests."}]


class StoredBlocks:
    """The engine's BlockStored events, as block hash -> parent hash (None at the root)."""

    def __init__(self, endpoint: str, secret: str) -> None:
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        secure_subscriber(self.sub, secret)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.parents: dict[bytes, bytes | None] = {}

    def chain(self, last: bytes, timeout_s: float = 10.0) -> list[bytes]:
        """The engine's chain of blocks ending at ``last``, root first (waits for its events)."""
        deadline = time.monotonic() + timeout_s
        while last not in self.parents:
            remaining = deadline - time.monotonic()
            assert remaining > 0 and self.sub.poll(remaining * 1000), \
                "the engine announced no block with the router's hash"
            _, _, payload = self.sub.recv_multipart()
            for event in msgpack.unpackb(payload)["events"]:
                if event["type"] == "BlockStored":
                    parent = event["parent_block_hash"]
                    for block in event["block_hashes"]:
                        self.parents[block] = parent
                        parent = block
        chain = [last]
        while self.parents[chain[-1]] is not None:
            chain.append(self.parents[chain[-1]])
        return chain[::-1]


def _post(router: str, path: str, body: dict, key: str = "alice-key") -> tuple[int, int, bytes]:
    """(prompt tokens the server ran, blocks and last hash the router routed on)."""
    resp = httpx.post(f"{router}{path}", json={"model": MODEL, "max_tokens": 2, **body},
                      headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    prompt_tokens = usage.get("prompt_tokens",
                              usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0))
    return (prompt_tokens, int(resp.headers["x-openinfer-prefix-blocks"]),
            bytes.fromhex(resp.headers.get("x-openinfer-prefix-hash", "")))


@pytest.mark.slow
def test_router_block_hashes_are_the_engines(qwen3_checkpoint, tmp_path):
    template = tmp_path / "persona.jinja"
    template.write_text(TEMPLATE)
    # Prefix caches salted per API key, on the replica and (so) in the router; KV events
    # encrypted for the holders of the secret (this test and the router).
    base, server = start_server(qwen3_checkpoint, "--chat-template", str(template),
                                "--kv-events-endpoint", "tcp://127.0.0.1:*",
                                "--api-key", "alice-key",
                                "bob-key", "--cache-salt-per-api-key",
                                "--kv-transfer-secret", "events-secret")
    events = json.loads(urllib.request.urlopen(f"{base}/kv_events", timeout=30).read())
    stored = StoredBlocks(events["endpoint"], "events-secret")  # subscribed as the router starts
    router, router_proc = start_router([base], qwen3_checkpoint, "--chat-template", str(template),
                                       "--cache-salt-per-api-key",
                                       "--kv-transfer-secret", "events-secret")
    try:
        requests = {
            "plain chat": ("/v1/chat/completions", {"messages": QUESTION}),
            "chat with template kwargs": ("/v1/chat/completions", {
                "messages": QUESTION, "chat_template_kwargs": {"persona": "a patient teacher"}}),
            "anthropic with system": ("/v1/messages", {
                "system": [{"type": "text", "text": "You are a storage engineer."}],
                "messages": [{"role": "user", "content": [
                    {"type": "text", "text": QUESTION[0]["content"]}]}]}),
            "completion of token ids": ("/v1/completions", {"prompt": list(range(200, 250))}),
        }
        lasts = {}
        for name, (path, body) in requests.items():
            prompt_tokens, blocks, last = _post(router, path, body)
            assert blocks == prompt_tokens // BLOCK_SIZE >= 2, name
            assert len(stored.chain(last)) == blocks, name  # the same prefix, block for block
            lasts[name] = last
        assert len(set(lasts.values())) == len(lasts)  # the kwarg changed the prompt
        # Another tenant's same prompt: other blocks, still the engine's.
        path, body = requests["completion of token ids"]
        prompt_tokens, blocks, bobs = _post(router, path, body, key="bob-key")
        assert len(stored.chain(bobs)) == blocks and bobs != lasts["completion of token ids"]
        # The router read the encrypted events too: its index of the replica is live.
        deadline = time.monotonic() + 10
        while not (worker := admin_workers(router)[0])["events"] or not worker["indexed_blocks"]:
            assert time.monotonic() < deadline, worker
            time.sleep(0.1)
    finally:
        stored.sub.close(linger=0)
        stop(router_proc)
        stop(server)
