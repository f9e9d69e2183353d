"""The router's admin API needs the admin key, and a client's credentials only reach the
replicas the operator named at start-up, never one added later through the admin API.

The replicas here are small HTTP servers in this process that answer like openinfer and
record the headers they receive: what a hostile replica would see is exactly the point.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from server_process import ADMIN, MODEL, admin_workers, start_router, stop


class RecordingReplica:
    """Answers /health, /metrics, /kv_events and /v1/completions; keeps request headers."""

    def __init__(self) -> None:
        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _reply(self, status: int, body: bytes, kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/kv_events":
                    self._reply(200, json.dumps({"endpoint": None}).encode())
                elif self.path == "/metrics":
                    self._reply(200, b"", "text/plain")
                else:
                    self._reply(200, b'{"status": "ok"}')

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                seen.append({k.lower(): v for k, v in self.headers.items()})
                self._reply(200, json.dumps({"choices": [{"text": "ok"}]}).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _request(url: str, method: str = "GET", body: dict | None = None,
             headers: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.mark.slow
def test_admin_key_and_credentials_reach_only_named_replicas(qwen3_checkpoint):
    named, added = RecordingReplica(), RecordingReplica()
    router, proc = start_router([named.url], qwen3_checkpoint, "--policy", "round_robin")
    try:
        # The admin API: refused without the key or with a wrong one.
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            status, body = _request(f"{router}/admin/workers", headers=headers)
            assert status == 401 and body["error"]["type"] == "authentication_error"
            status, _ = _request(f"{router}/admin/workers", "POST", {"url": added.url}, headers)
            assert status == 401
        assert [w["url"] for w in admin_workers(router)] == [named.url]

        client = {"Authorization": "Bearer client-secret"}
        completion = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        assert _request(f"{router}/v1/completions", "POST", completion, client)[0] == 200
        assert named.seen[-1]["authorization"] == "Bearer client-secret"

        assert _request(f"{router}/admin/workers", "POST", {"url": added.url}, ADMIN)[0] == 200
        status, _ = _request(f"{router}/admin/workers?url={named.url}", "DELETE", headers=ADMIN)
        assert status == 200
        deadline = time.monotonic() + 10
        while not added.seen and time.monotonic() < deadline:
            _request(f"{router}/v1/completions", "POST", completion, client)
        assert added.seen, "the added replica never got a request"
        assert all("authorization" not in h and "x-api-key" not in h for h in added.seen)
    finally:
        stop(proc)
        named.close()
        added.close()


@pytest.mark.slow
def test_admin_api_is_refused_when_no_key_is_set(qwen3_checkpoint, monkeypatch):
    replica = RecordingReplica()
    monkeypatch.delenv("OPENINFER_ADMIN_API_KEY", raising=False)
    router, proc = start_router([replica.url], qwen3_checkpoint, admin_key=None)
    try:
        status, body = _request(f"{router}/admin/workers", headers=ADMIN)
        assert status == 403 and "--admin-api-key" in body["error"]["message"]
    finally:
        stop(proc)
        replica.close()
