"""`openinfer serve` start-up options, as a new user meets them: the socket bound before the
model loads, on the address --host names, keys and flags from the environment, a chat template and
sampling defaults from flags, help with defaults, `--version` and `python -m openinfer`."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from server_process import MODEL, start_server, stop

from openinfer import LLM, SamplingParams

TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}<<go>>"


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "openinfer", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_version_help_and_module_entry_point():
    version = _cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("openinfer ")
    help_text = _cli("serve", "--help").stdout
    for shown in ("(default: 8000)", "(default: auto)", "--no-enable-prefix-caching",
                  "--generation-config", "--chat-template", "--disable-uvicorn-access-log",
                  "OPENINFER_API_KEY"):
        assert shown in help_text, shown


def test_a_port_in_use_fails_at_once_with_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        # The model does not exist either: the port is checked before anything is loaded.
        res = _cli("serve", "--model", "/nonexistent/model", "--port", str(port))
        elapsed = time.monotonic() - start
    assert res.returncode == 2, res.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in res.stderr and "Traceback" not in res.stderr
    assert elapsed < 30  # python + torch import; no model load


@pytest.mark.slow
def test_keys_template_generation_defaults_and_async_scheduling(qwen3_checkpoint, tmp_path,
                                                                monkeypatch):
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    defaults = tmp_path / "defaults"
    defaults.mkdir()
    (defaults / "generation_config.json").write_text(json.dumps({"temperature": 0.0,
                                                                 "max_new_tokens": 5}))
    monkeypatch.setenv("OPENINFER_API_KEY", "from-env")
    # Environment mirrors of flags: one the command line also gives (it wins), one it does not.
    monkeypatch.setenv("OPENINFER_SERVED_MODEL_NAME", "named-by-env")
    monkeypatch.setenv("OPENINFER_MAX_MODEL_LEN", "200")
    base, proc = start_server(qwen3_checkpoint, "--chat-template", str(template),
                              "--generation-config", str(defaults),
                              "--disable-uvicorn-access-log", "--async-scheduling",
                              admin_key=None, host="127.0.0.2")
    try:
        # --host: it listens on that loopback address only, not on the default 127.0.0.1.
        port = int(base.rsplit(":", 1)[1])
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=10).close()

        # The key came from the environment; admin endpoints fall back to it.
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{base}/v1/models", timeout=30)
        assert refused.value.code == 401
        reset = urllib.request.Request(f"{base}/v1/cache/reset", method="POST",
                                       headers={"Authorization": "Bearer from-env"})
        assert json.loads(urllib.request.urlopen(reset, timeout=30).read())["reset"]

        client = openai.OpenAI(base_url=f"{base}/v1", api_key="from-env", max_retries=0)
        served = client.models.list().data[0]
        assert served.id == MODEL and served.max_model_len == 200
        offline = LLM(str(qwen3_checkpoint), progress=False)
        tokenizer = offline.get_tokenizer()
        messages = [{"role": "user", "content": "Hi"}]
        rendered = tokenizer.encode("<<user>>Hi<<go>>", add_special_tokens=False)
        # The server's template renders the chat; its generation config makes an unset
        # temperature greedy and an unset max_tokens 5.
        expected = offline.generate(rendered, SamplingParams(temperature=0, max_tokens=5))[0]
        chat = client.chat.completions.create(model=MODEL, messages=messages)
        assert chat.usage.prompt_tokens == len(rendered)
        assert chat.usage.completion_tokens == len(expected.outputs[0].token_ids)
        assert chat.choices[0].message.content == expected.outputs[0].text
        # A request's own values win over the defaults.
        longer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7,
                                                extra_body={"ignore_eos": True})
        assert longer.usage.completion_tokens == 7

        # Asynchronous scheduling: concurrent streams (one closed early) get the tokens of
        # the synchronous offline engine.
        prompts = [[5 + i, 90, 17 * i + 3, 41, 7] * (i + 1) for i in range(4)]
        lengths = [3, 9, 16, 12]
        want = offline.generate(prompts, [SamplingParams(temperature=0, max_tokens=n,
                                                         ignore_eos=True) for n in lengths])

        def stream(i: int) -> str:
            chunks = client.completions.create(model=MODEL, prompt=prompts[i], stream=True,
                                               max_tokens=lengths[i], temperature=0,
                                               extra_body={"ignore_eos": True})
            text = ""
            for chunk in chunks:
                text += chunk.choices[0].text
                if i == 3 and len(text) > 3:
                    chunks.close()  # the client goes away mid-stream
                    break
            return text

        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(stream, range(4)))
        assert texts[:3] == [o.outputs[0].text for o in want[:3]]
        assert want[3].outputs[0].text.startswith(texts[3])
        again = client.completions.create(model=MODEL, prompt=prompts[3], max_tokens=12,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert again.choices[0].text == want[3].outputs[0].text
    finally:
        stop(proc)


@pytest.mark.slow
def test_float8_kv_cache_flag(qwen3_checkpoint):
    """`serve --kv-cache-dtype fp8`: a completion with the offline float8 engine's text, and
    /metrics' cache_config_info says fp8 (the engine's own tests: tests/engine/test_fp8_kv_cache.py)."""
    prompt = [(7 * j) % 900 + 5 for j in range(40)]
    offline = LLM(str(qwen3_checkpoint), kv_cache_dtype="fp8", progress=False)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = offline.generate([{"prompt_token_ids": prompt}], greedy)[0].outputs[0].text
    offline.engine.core.shutdown()
    base, proc = start_server(qwen3_checkpoint, "--kv-cache-dtype", "fp8", admin_key=None)
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert answer.choices[0].text == expected
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
        info = next(line for line in metrics.splitlines() if "cache_config_info{" in line)
        assert 'cache_dtype="fp8"' in info
    finally:
        stop(proc)
    refused = _cli("serve", "--model", str(qwen3_checkpoint), "--kv-cache-dtype", "int8")
    assert refused.returncode == 2 and "invalid choice: 'int8'" in refused.stderr
