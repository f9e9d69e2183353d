"""The chat page at ``/`` (llama.cpp's server has one): its two files are served without the
API key, and the page's protocol, ``streamChat`` in the served chat.js, run in node against
the real server, streams the text of the chat completion the official client gets and the
usage the page shows (the next turn's cached tokens); a wrong key is an error with the
server's message. (No headless browser runs the page's DOM code here: see the gap in
docs/serving.md.)"""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import openai
import pytest
from server_process import MODEL, start_server, stop

NODE = shutil.which("node")
RUN = """
const {streamChat} = require(process.argv[2]);
(async () => {
  let text = "", usage = null;
  try {
    for await (const piece of streamChat(process.argv[3], process.argv[4], JSON.parse(process.argv[5]))) {
      if (piece.text) text += piece.text;
      if (piece.usage) usage = piece.usage;
    }
    console.log(JSON.stringify({text, usage}));
  } catch (error) {
    console.log(JSON.stringify({error: error.message}));
  }
})();
"""


@pytest.mark.skipif(NODE is None, reason="node is not installed (the page's script runs in it)")
def test_the_chat_page_streams_what_the_api_answers(qwen3_checkpoint, tmp_path):
    base, proc = start_server(qwen3_checkpoint, "--api-key", "page-key")
    try:
        page = httpx.get(f"{base}/", timeout=30)
        script = httpx.get(f"{base}/chat.js", timeout=30)
        assert page.status_code == script.status_code == 200  # no key needed for these
        assert page.headers["content-type"].startswith("text/html")
        assert '<script src="/chat.js">' in page.text and "streamChat" in script.text
        (tmp_path / "chat.js").write_text(script.text)
        (tmp_path / "run.js").write_text(RUN)

        messages = [{"role": "user", "content": "Say something."}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}

        def node(key: str) -> dict:
            out = subprocess.run([NODE, str(tmp_path / "run.js"), str(tmp_path / "chat.js"),
                                  base, key, json.dumps(body)],
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)

        client = openai.OpenAI(base_url=f"{base}/v1", api_key="page-key", max_retries=0)
        want = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                              temperature=0, extra_body={"ignore_eos": True})
        first = node("page-key")
        assert first["text"] == want.choices[0].message.content
        assert first["usage"]["prompt_tokens"] == want.usage.prompt_tokens
        # The turn after it: the page shows how much of its prompt was a cache hit.
        messages += [{"role": "assistant", "content": first["text"]},
                     {"role": "user", "content": "More."}]
        second = node("page-key")
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= want.usage.prompt_tokens
        refused = node("wrong-key")
        assert "error" in refused and "key" in refused["error"].lower()
    finally:
        stop(proc)
