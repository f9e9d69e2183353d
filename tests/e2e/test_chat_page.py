"""The chat page at ``/`` (llama.cpp's server has one): its two files are served without the
API key, and the page's protocol, ``streamChat`` in the served chat.js, run in node against
the real server, streams the text of the chat completion the official client gets and the
usage the page shows (the next turn's cached tokens); a wrong key is an error with the
server's message. And the page itself runs in a headless Chromium (Debian's package, driven
over the DevTools protocol: tests/e2e/browser.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import httpx
import openai
import pytest
from browser import Browser, chromium
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


MESSAGES_JS = ("JSON.stringify([...document.querySelectorAll('#log .msg')]"
               ".map(d => [d.className, d.textContent]))")


def test_the_chat_page_in_a_headless_browser(qwen3_checkpoint, tmp_path):
    """The page itself, in Chromium: a link's first message is sent and streamed into the
    conversation with its usage line; a second turn, typed in, shows its cached tokens."""
    executable = chromium()
    if executable is None:
        pytest.skip("no Chromium here, and none can be installed (apt-get install chromium, as root)")
    base, proc = start_server(qwen3_checkpoint)
    browser = Browser(executable, tmp_path / "profile")
    try:
        browser.open(f"{base}/?q=Say%20something.&temperature=0&max_tokens=12")
        log = json.loads(browser.wait_for(f"document.querySelector('#log .usage') && {MESSAGES_JS}"))
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Say something."}]
        want = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                              temperature=0)
        answer = want.choices[0].message.content
        assert log[:2] == [["msg user", "Say something."], ["msg assistant", answer]]
        assert log[2][0] == "msg usage" and log[2][1].startswith(
            f"prompt {want.usage.prompt_tokens} tokens")
        assert browser.evaluate("document.getElementById('model').textContent") == MODEL

        browser.evaluate("document.getElementById('input').value = 'More.';"
                         "document.getElementById('form').requestSubmit(); true")
        log = json.loads(browser.wait_for(
            f"document.querySelectorAll('#log .usage').length == 2 && {MESSAGES_JS}"))
        assert [kind for kind, _ in log] == ["msg user", "msg assistant", "msg usage"] * 2
        cached = int(re.search(r"\((\d+) cached\)", log[5][1]).group(1))
        assert cached >= want.usage.prompt_tokens  # the first turn was a prefix-cache hit
    finally:
        browser.close()
        stop(proc)
