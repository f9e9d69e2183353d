"""Speculative decoding through the real server: streamed and whole completions and chats
give plain decoding's greedy text (a DSpark drafter's too), the spec_decode counters move,
and a bad --speculative-config stops the server at start with the reason."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest
from dspark_checkpoint import build_dspark_drafter
from server_process import MODEL, metrics, start_server, stop

from openinfer import LLM, SamplingParams

SPEC = json.dumps({"method": "suffix", "num_speculative_tokens": 4, "scheduler": "confidence"})


def _assert_streamed_chat_is_plain(client: openai.OpenAI, offline: LLM, prompt: str,
                                   max_tokens: int) -> None:
    """A streamed greedy chat of ``prompt`` gives the offline engine's text for the same ids."""
    messages = [{"role": "user", "content": prompt}]
    tok = offline.get_tokenizer()
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    expected = offline.generate([ids], SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].outputs[0].text
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected


@pytest.mark.slow
def test_speculative_server_streams_plain_greedy_text(qwen3_checkpoint, tmp_path):
    offline = LLM(str(qwen3_checkpoint), progress=False)
    spec = json.loads(SPEC) | {"sps_cache_dir": str(tmp_path)}
    base, proc = start_server(qwen3_checkpoint, "--speculative-config", json.dumps(spec))
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        prompt = "the cat sat on the mat and the cat sat on the mat and the"
        expected = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=40,
                                                           ignore_eos=True))[0].outputs[0]
        args = dict(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                    extra_body={"ignore_eos": True})
        whole = client.completions.create(**args)
        assert whole.choices[0].text == expected.text
        assert whole.usage.completion_tokens == 40
        streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True)
                           if c.choices)
        assert streamed == expected.text
        # A stop string inside the text: both paths end at the same place.
        stop_word = expected.text.split()[len(expected.text.split()) // 2]
        want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                       stop=[stop_word]))[0].outputs[0]
        got = client.completions.create(**args | {"stop": [stop_word]})
        assert (got.choices[0].text, got.choices[0].finish_reason) == (want.text, "stop")
        assert got.usage.completion_tokens == len(want.token_ids)
        _assert_streamed_chat_is_plain(client, offline, prompt, 24)
        values = metrics(base)
        assert values["openinfer:spec_decode_num_draft_tokens_total"] > 0
        assert values["openinfer:spec_decode_num_accepted_tokens_total"] > 0
        assert values["openinfer:spec_decode_num_accepted_tokens_per_pos_total[0]"] > 0
    finally:
        stop(proc)


def test_a_bad_speculative_config_stops_the_server_with_the_reason(qwen3_checkpoint):
    bad = json.dumps({"method": "ngram", "num_speculative_tokens": 40})
    proc = subprocess.run([sys.executable, "-m", "openinfer.cli", "serve", "--model",
                           str(qwen3_checkpoint), "--speculative-config", bad, "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "num_speculative_tokens must be an integer in [1, 16]" in proc.stderr + proc.stdout


def test_a_dspark_drafter_serves_plain_greedy_text(qwen3_checkpoint, tmp_path):
    """--speculative-config with a DSpark drafter checkpoint: the server loads it beside the
    target, and a streamed chat and a whole completion are plain decoding's text while its
    drafts are verified."""
    drafter = build_dspark_drafter(tmp_path / "dspark", qwen3_checkpoint)
    offline = LLM(str(qwen3_checkpoint), progress=False)
    spec = {"method": "dspark", "model": str(drafter), "num_speculative_tokens": 3}
    base, proc = start_server(qwen3_checkpoint, "--speculative-config", json.dumps(spec))
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        prompt = "the cat sat on the mat and the"
        expected = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=20,
                                                           ignore_eos=True))[0].outputs[0].text
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert whole.choices[0].text == expected
        _assert_streamed_chat_is_plain(client, offline, prompt, 16)
        assert metrics(base)["openinfer:spec_decode_num_draft_tokens_total"] > 0
    finally:
        stop(proc)
