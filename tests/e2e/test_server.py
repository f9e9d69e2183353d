"""The OpenAI-compatible server as a real process on loopback, driven by the openai client."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
from server_process import MODEL, admin_workers, process_running, start_router, start_servers, stop
from server_process import metrics as _metrics

from openinfer import LLM, SamplingParams
from openinfer.server.openai_protocol import MAX_LOGPROBS, MAX_MESSAGES, MAX_N, MAX_PROMPTS, MAX_STOP

SERVERS = {  # every server this module starts, by the test(s) using it: name -> flags
    "shared": ("--kv-cache-memory", "16MiB"),  # the `server` fixture
    "clean_shutdown": (),  # test_models_and_clean_shutdown stops it
    "limits": ("--api-key", "sekrit", "--max-body-bytes", "2000", "--max-num-seqs", "1",
               "--max-waiting-requests", "0"),  # test_api_key_body_size_and_queue_limits
    # test_a_dead_engine_gives_503_then_restarts kills its engine core, twice
    "dead_engine": ("--restart-on-engine-failure", "--max-engine-restarts", "1",
                    "--kv-events-endpoint", "tcp://127.0.0.1:*",
                    "--kv-events-replay-endpoint", "tcp://127.0.0.1:*"),
    # test_tenants_never_share_cached_prefixes, test_a_request_past_its_timeout_is_aborted
    "tenants": ("--api-key", "alice-key", "bob-key", "--cache-salt-per-api-key",
                "--admin-api-key", "root-key", "--request-timeout", "1"),
    # test_priority_scheduling_orders_the_waiting_requests, test_idle_connections_stay_open...
    "priority": ("--scheduling-policy", "priority", "--max-num-seqs", "1",
                 "--metrics-engine-index", "3", "--timeout-keep-alive", "2"),
}


@pytest.fixture(scope="module")
def servers(qwen3_checkpoint) -> dict[str, tuple[str, subprocess.Popen]]:
    """SERVERS, all started at once (their start-ups overlap) the first time one is needed;
    each is used by its own test(s) only, so no test sees another's leftovers."""
    started = start_servers(*[(qwen3_checkpoint, *flags) for flags in SERVERS.values()])
    yield dict(zip(SERVERS, started))
    for _, proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(servers):
    return servers["shared"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(qwen3_checkpoint) -> LLM:
    return LLM(str(qwen3_checkpoint), progress=False)


def _stream_text(stream) -> tuple[str, str | None, dict | None]:
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            text += piece
            finish = choice.finish_reason or finish
    return text, finish, usage


@pytest.mark.slow
def test_completions_stream_and_not_give_the_offline_text(client, offline):
    prompt = "The quick brown fox"
    expected = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                                       ignore_eos=True))[0]
    args = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    assert whole.choices[0].text == expected.outputs[0].text
    assert whole.choices[0].finish_reason == "length"
    usage = whole.usage.model_dump()
    assert usage["prompt_tokens"] == len(expected.prompt_token_ids)
    assert usage["completion_tokens"] == 12 and usage["total_tokens"] == usage["prompt_tokens"] + 12
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage["prompt_cache_miss_tokens"] == usage["prompt_tokens"]
    text, finish, stream_usage = _stream_text(client.completions.create(
        **args, stream=True, stream_options={"include_usage": True}))
    assert (text, finish) == (expected.outputs[0].text, "length")
    assert stream_usage["completion_tokens"] == 12


@pytest.mark.slow
def test_usage_reports_prefix_cache_hits_per_salt(client):
    prompt = list(range(5, 45))  # 40 token ids: two full blocks can hit
    args = dict(model=MODEL, prompt=prompt, max_tokens=2)
    salt = lambda s: {"extra_body": {"cache_salt": s}}
    first = client.completions.create(**args, **salt("usage-test")).usage.model_dump()
    again = client.completions.create(**args, **salt("usage-test")).usage.model_dump()
    other = client.completions.create(**args, **salt("another-tenant")).usage.model_dump()
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["prompt_tokens_details"]["cached_tokens"] == 32
    assert again["prompt_cache_hit_tokens"] == 32 and again["prompt_cache_miss_tokens"] == 8
    metrics = _metrics(client.base_url.__str__().removesuffix("/v1/"))
    assert metrics["openinfer:prefix_cache_hits_total"] >= 32
    assert metrics["openinfer:prefix_cache_queries_total"] >= 120
    assert other["prompt_tokens_details"]["cached_tokens"] == 0
    stream = client.completions.create(**args, **salt("usage-test"), stream=True,
                                       stream_options={"include_usage": True})
    streamed = _stream_text(stream)[2]
    assert streamed["prompt_tokens_details"]["cached_tokens"] == 32
    # Where the prompt came from: the device tier (this server has no other), the rest computed.
    hit = {"L1": 32, "L2": 0, "L3": 0, "pulled": 0, "computed": 8}
    assert again["prompt_tokens_by_source"] == streamed["prompt_tokens_by_source"] == hit
    assert first["prompt_tokens_by_source"] == {**hit, "L1": 0, "computed": 40}


@pytest.mark.slow
def test_echo_with_logprobs_scores_the_prompt(client, offline):
    prompt = "Hello world, again"
    scored = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=1,
                                                     prompt_logprobs=1, ignore_eos=True))[0]
    ids = scored.prompt_token_ids
    args = dict(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args).choices[0]
    streamed = list(client.completions.create(**args, stream=True))
    first = streamed[0].choices[0]
    assert whole.text == prompt + scored.outputs[0].text
    assert first.text.startswith(prompt)
    for lp in (whole.logprobs, first.logprobs):
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        expected = [scored.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i]
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=1e-4)
    assert len(whole.logprobs.tokens) == len(ids) + 3
    assert whole.logprobs.token_logprobs[len(ids):] == pytest.approx(
        [e[t].logprob for t, e in zip(scored.outputs[0].token_ids, scored.outputs[0].logprobs)],
        abs=1e-4)
    assert "".join(whole.logprobs.tokens) == whole.text
    assert whole.logprobs.text_offset[-1] == len(whole.text) - len(whole.logprobs.tokens[-1])


@pytest.mark.slow
def test_64_concurrent_streaming_chats_match_each_run_alone(server, offline):
    tok = offline.get_tokenizer()
    chats = [[{"role": "user", "content": f"Question {i}: what is {i} plus {i * 7}?"}]
             for i in range(64)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = []
    for chat in chats:  # each alone, offline
        ids = tok.encode(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)
        expected.append(offline.generate([ids], greedy)[0].outputs[0].text)

    async def one(client: openai.AsyncOpenAI, chat: list[dict]) -> tuple[str, str, int]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=chat, max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
                sources = chunk.usage.prompt_tokens_by_source
                assert sum(sources.values()) == chunk.usage.prompt_tokens
                assert sources["L1"] == chunk.usage.prompt_tokens_details.cached_tokens
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return text, finish, usage

    async def all_at_once() -> list[tuple[str, str, int]]:
        async with openai.AsyncOpenAI(base_url=f"{server[0]}/v1", api_key="unused",
                                      max_retries=0, timeout=300) as client:
            return await asyncio.gather(*(one(client, chat) for chat in chats))

    results = asyncio.run(all_at_once())
    assert [r[0] for r in results] == expected
    assert all(finish == "length" and usage == 16 for _, finish, usage in results)


@pytest.mark.slow
def test_unhonourable_tool_and_reasoning_fields_are_refused_by_name(server, client):
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for extra, param, code in (
            # tool_choice auto needs --tool-call-parser (test_structured_server.py: with it).
            ({"tools": [tool]}, "tool_choice", None),
            ({"functions": [tool["function"]]}, "functions", "unsupported_parameter"),
            ({"reasoning_effort": "high"}, "reasoning_effort", "unsupported_parameter")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(**chat, **extra)
        error = refused.value.body
        assert error["param"] == param and error["code"] == code, error
    # Harmless fields and the text format are accepted.
    ok = client.chat.completions.create(**chat, response_format={"type": "text"}, user="u",
                                        metadata={"k": "v"}, tool_choice="none")
    assert ok.choices[0].message.content is not None
    messages = anthropic.Anthropic(base_url=server[0], api_key="unused", max_retries=0).messages
    with pytest.raises(anthropic.BadRequestError) as refused:
        messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                        tools=[{"name": "f", "input_schema": {"type": "object"}}])
    assert "--tool-call-parser" in str(refused.value)  # tool_choice auto, the default


@pytest.mark.slow
def test_vllm_sampling_extras_match_offline(client, offline):
    """logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens and priority reach
    the engine: the server's tokens equal the offline engine's with the same parameters."""
    prompt = list(range(20, 60))
    base = dict(temperature=0, max_tokens=6, ignore_eos=True)
    cases = [
        {"logit_bias": {"77": 100}},
        {"allowed_token_ids": [11, 12, 13]},
        {"bad_words": ["the", "and"]},
        {"truncate_prompt_tokens": 9},
        {"priority": 3},
    ]
    for extra in cases:
        params = dict(extra)
        if "logit_bias" in params:
            params["logit_bias"] = {int(k): v for k, v in params["logit_bias"].items()}
        expected = offline.generate(prompt, SamplingParams(**base, **params))[0]
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True, **extra})
        tokens = offline.get_tokenizer().encode(out.choices[0].text, add_special_tokens=False)
        assert out.choices[0].text == expected.outputs[0].text, extra
        assert out.usage.prompt_tokens == len(expected.prompt_token_ids), extra
        if "logit_bias" in extra:
            assert expected.outputs[0].token_ids == [77] * 6
        if "allowed_token_ids" in extra:
            assert set(expected.outputs[0].token_ids) <= {11, 12, 13} and tokens
        if "truncate_prompt_tokens" in extra:
            assert out.usage.prompt_tokens == 9


SEEDED = dict(temperature=0.9, seed=11, max_tokens=24)
GREEDY24 = dict(temperature=0, max_tokens=24)
SAMPLING_FIELDS = {  # id: (the request's fields, beyond model and prompt)
    "top_k": {**SEEDED, "top_k": 5},
    "min_p": {**SEEDED, "min_p": 0.2},
    "top_p": {**SEEDED, "top_p": 0.5},
    "presence_penalty": {**GREEDY24, "presence_penalty": 2.0},  # greedy repeats a token:
    "frequency_penalty": {**GREEDY24, "frequency_penalty": 2.0},  # the penalties change it
    "repetition_penalty": {**GREEDY24, "repetition_penalty": 2.0},
    "stop_token_ids": {**SEEDED, "stop_token_ids": "the 4th token"},
    "min_tokens": {**SEEDED, "stop_token_ids": "the 4th token", "min_tokens": 10},
    "stop": {**GREEDY24, "stop": "a piece of the text"},
    "n": {**SEEDED, "n": 3},
}


@pytest.mark.slow
@pytest.mark.parametrize("field", [*SAMPLING_FIELDS, "prompt list"])
def test_each_sampling_field_over_http_equals_offline(client, offline, field):
    """A field reaches the engine as the offline API's SamplingParams: the same text, and
    not the text without the field (so an ignored field fails)."""
    prompt = list(range(30, 70))
    if field == "prompt list":
        prompts = [prompt, list(range(90, 120)), list(range(5, 60))]
        expected = [o.outputs[0].text for o in offline.generate(prompts, SamplingParams(
            **GREEDY24))]
        out = client.completions.create(model=MODEL, prompt=prompts, **GREEDY24)
        assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == expected
        assert len(set(expected)) == 3
        return
    fields = dict(SAMPLING_FIELDS[field])
    plain = offline.generate([prompt], SamplingParams(
        **(SEEDED if "seed" in fields else GREEDY24)))[0].outputs[0]
    if fields.get("stop_token_ids") == "the 4th token":
        fields["stop_token_ids"] = [plain.token_ids[3]]
    if fields.get("stop") == "a piece of the text":
        fields["stop"] = [plain.text[len(plain.text) // 2:][:3]]

    def texts(params: dict) -> list[str]:
        return [c.text for c in offline.generate([prompt], SamplingParams(**params))[0].outputs]

    expected = texts(fields)
    out = client.completions.create(model=MODEL, prompt=prompt, extra_body=fields)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == expected
    assert expected != texts({k: v for k, v in fields.items() if k != field})


@pytest.mark.slow
def test_chat_stream_n_logprobs_stop_and_seed(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    tok = offline.get_tokenizer()
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    expected = offline.generate([ids], SamplingParams(temperature=0, max_tokens=10,
                                                      ignore_eos=True))[0].outputs[0]
    args = dict(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0,
                extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args, logprobs=True, top_logprobs=2)
    assert whole.choices[0].message.content == expected.text
    assert whole.choices[0].message.role == "assistant"
    content = whole.choices[0].logprobs.content
    assert len(content) == 10 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
    text, finish, _ = _stream_text(client.chat.completions.create(**args, stream=True))
    assert (text, finish) == (expected.text, "length")

    stop = expected.text[3:6]
    stopped = client.chat.completions.create(**args, stop=[stop])
    assert stopped.choices[0].message.content == expected.text[:expected.text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"

    sampled = dict(model=MODEL, messages=messages, max_tokens=8, temperature=1.0, seed=7, n=2)
    a = client.chat.completions.create(**sampled)
    b = client.chat.completions.create(**sampled)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


def _post(base: str, path: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.slow
@pytest.mark.parametrize("body,status,param", [
    ({"model": "nope", "prompt": "hi"}, 404, "model"),
    ({"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "stop": 3}, 400, "stop"),
    (b"{not json", 400, None),
    # Fields we cannot honour are refused by name, never ignored.
    ({"model": MODEL, "prompt": "hi", "best_of": 2}, 400, "best_of"),
    ({"model": MODEL, "prompt": "hi", "response_format": {"type": "yaml"}}, 400,
     "response_format"),
    ({"model": MODEL, "prompt": "hi", "guided_json": {"type": "objec"}}, 400, "guided_json"),
    ({"model": MODEL, "prompt": "hi", "guided_regex": "(", "guided_choice": ["a"]}, 400,
     "guided_choice"),
    ({"model": MODEL, "prompt": "hi", "use_beam_search": True}, 400, "use_beam_search"),
    ({"model": MODEL, "prompt": "hi", "no_such_field": 1}, 400, "no_such_field"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"1": 101}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ({"model": MODEL, "prompt": "hi", "truncate_prompt_tokens": 0}, 400,
     "truncate_prompt_tokens"),
    ({"model": MODEL, "prompt": "hi", "kv_transfer_params": {"remote_engine_id": "x"}}, 400,
     "kv_transfer_params"),
    ({"model": MODEL, "prompt": "hi", "kv_transfer_params": {
        "remote_host": "h", "remote_port": 1, "remote_block_hashes": ["zz"]}}, 400,
     "kv_transfer_params"),
    ({"model": MODEL, "prompt": "hi", "kv_transfer_params": {  # a host per rank port
        "remote_host": "h", "remote_port": 1, "remote_rank_ports": [1, 2],
        "remote_rank_hosts": ["h"]}}, 400, "kv_transfer_params"),
    # Caps on what one request may ask for.
    ({"model": MODEL, "prompt": "hi", "n": MAX_N + 1}, 400, "n"),
    ({"model": MODEL, "prompt": "hi", "stop": ["x"] * (MAX_STOP + 1)}, 400, "stop"),
    ({"model": MODEL, "prompt": "hi", "logprobs": MAX_LOGPROBS + 1}, 400, "logprobs"),
    ({"model": MODEL, "prompt": ["hi"] * (MAX_PROMPTS + 1)}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, param):
    base, _ = server
    code, payload = _post(base, "/v1/completions", body)
    assert code == status, payload
    error = payload["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param)
    code, ok = _post(base, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert code == 200 and ok["usage"]["completion_tokens"] >= 1


@pytest.mark.slow
def test_models_and_clean_shutdown(servers):
    base, proc = servers["clean_shutdown"]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    schema = json.loads(urllib.request.urlopen(f"{base}/openapi.json", timeout=10).read())
    assert {"/v1/completions", "/v1/chat/completions", "/v1/messages"} <= set(schema["paths"])
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    child_pids = [int(p) for p in children.stdout.split()]
    assert child_pids, "the engine core runs in a child process"
    # SIGTERM under load (6 streams, 4 non-streamed requests in flight): each runs to its
    # end (within --shutdown-timeout, 30 s) before the server goes; new connections are
    # refused meanwhile.
    long = {"model": MODEL, "max_tokens": 150, "extra_body": {"ignore_eos": True}}
    streams = [iter(client.completions.create(prompt=f"drain me {i}", stream=True, **long))
               for i in range(6)]
    firsts = [next(chunks) for chunks in streams]
    with ThreadPoolExecutor(4) as pool:
        plain = [pool.submit(client.completions.create, prompt=f"drain plain {i}", **long)
                 for i in range(4)]
        deadline = time.monotonic() + 60
        while sum(_metrics(base)[f"openinfer:num_requests_{state}"] for state in
                  ("running", "waiting")) < 10:
            assert time.monotonic() < deadline, "the 10 requests never all reached the engine"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        host, port = base.removeprefix("http://").split(":")
        while True:  # the listener closes (the drain has begun)
            try:
                probe = http.client.HTTPConnection(host, int(port), timeout=5)
                probe.connect()
                probe.close()
            except ConnectionRefusedError:
                break
            assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
            time.sleep(0.02)
        with pytest.raises(openai.APIConnectionError):  # nothing new is let in
            client.completions.create(model=MODEL, prompt="too late", max_tokens=2)
        answers = [future.result() for future in plain]
        rests = [list(chunks) for chunks in streams]
    assert all(a.usage.completion_tokens == 150 and a.choices[0].finish_reason == "length"
               for a in answers)
    for first, rest in zip(firsts, rests):  # each ran to max_tokens
        assert rest[-1].choices[0].finish_reason == "length"
        assert "".join(c.choices[0].text for c in [first, *rest])
    # uvicorn shuts down gracefully, then re-raises the signal so the exit status tells it.
    assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    deadline = time.monotonic() + 10  # helpers (e.g. multiprocessing's tracker) exit on EOF
    while any(process_running(pid) for pid in child_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in child_pids:
        assert not process_running(pid), f"child {pid} outlived the server"


@pytest.mark.slow
def test_tokenize_and_detokenize(server, offline):
    base, _ = server
    code, out = _post(base, "/tokenize", {"model": MODEL, "prompt": "Hello world"})
    assert code == 200 and out["tokens"] == offline.get_tokenizer().encode("Hello world")
    code, chat = _post(base, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    tok = offline.get_tokenizer()
    expected = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                                  tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
    assert code == 200 and chat["tokens"] == expected and chat["count"] == len(expected)
    code, text = _post(base, "/detokenize", {"tokens": out["tokens"]})
    assert code == 200 and text["prompt"] == "Hello world"
    code, err = _post(base, "/detokenize", {"tokens": [10**9]})
    assert code == 400 and err["error"]["param"] == "tokens"


def test_llamacpp_props_and_slots(server, client, offline):
    """llama.cpp's /props (model, context, template, tokens, defaults, capacity) and /slots
    (one entry per request in flight, gone when it ends)."""
    base, _ = server
    with urllib.request.urlopen(base + "/props", timeout=30) as resp:
        props = json.loads(resp.read())
    tok = offline.get_tokenizer()
    assert props["model_alias"] == MODEL and props["chat_template"] == tok.chat_template
    assert props["eos_token"] == tok.eos_token and props["total_slots"] >= 1
    assert props["default_generation_settings"]["n_ctx"] == offline.engine.config.model.max_model_len
    stream = client.chat.completions.create(model=MODEL, max_tokens=200, stream=True, temperature=1.0,
                                            messages=[{"role": "user", "content": "Count."}],
                                            extra_body={"ignore_eos": True})
    next(iter(stream))
    with urllib.request.urlopen(base + "/slots", timeout=30) as resp:
        slots = json.loads(resp.read())
    assert len(slots) == 1 and slots[0]["is_processing"]
    assert slots[0]["params"]["n_predict"] == 200 and slots[0]["params"]["temperature"] == 1.0
    prompt = tok.apply_chat_template([{"role": "user", "content": "Count."}], tokenize=False,
                                      add_generation_prompt=True)
    assert slots[0]["n_prompt_tokens"] == len(tok.encode(prompt, add_special_tokens=False))
    stream.close()
    _wait_idle(base)
    with urllib.request.urlopen(base + "/slots", timeout=30) as resp:
        assert json.loads(resp.read()) == []


async def _burst(base: str, count: int) -> tuple[int, int]:
    """Send ``count`` long streams at once; (admitted, refused with 503 + Retry-After)."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 450, "ignore_eos": True,
            "stream": True}
    async with httpx.AsyncClient(base_url=base, timeout=60,
                                 headers={"Authorization": "Bearer sekrit"}) as http:
        async def one() -> int:
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                answered.append(resp.status_code)
                if resp.status_code == 503:
                    assert resp.headers["retry-after"] == "1"
                    return 503
                assert resp.status_code == 200
                await gate.wait()  # every answer has started: close the admitted streams
                return 200

        gate, answered = asyncio.Event(), []
        tasks = [asyncio.create_task(one()) for _ in range(count)]
        deadline = time.monotonic() + 30
        while len(answered) < count:  # every status (200 or 503) is in before a stream closes
            assert time.monotonic() < deadline, f"{len(answered)} of {count} answered"
            await asyncio.sleep(0.05)
        gate.set()
        codes = await asyncio.gather(*tasks)
    return codes.count(200), codes.count(503)


def _wait_idle(base: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while any(_metrics(base)[f"openinfer:num_requests_{state}"] for state in ("running", "waiting")):
        assert time.monotonic() < deadline, "the engine never went idle"
        time.sleep(0.1)


@pytest.mark.slow
def test_api_key_body_size_and_queue_limits(servers):
    # --api-key sekrit --max-body-bytes 2000 --max-num-seqs 1 --max-waiting-requests 0
    base, proc = servers["limits"]
    try:
        assert urllib.request.urlopen(f"{base}/health").status == 200  # probes need no key
        code, err = _post(base, "/v1/completions", {"model": MODEL, "prompt": "hi"})
        assert code == 401 and err["error"]["type"] == "authentication_error"
        keyed = openai.OpenAI(base_url=f"{base}/v1", api_key="sekrit", max_retries=0)
        assert keyed.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
        with pytest.raises(openai.APIStatusError) as big:
            keyed.completions.create(model=MODEL, prompt="x" * 5000, max_tokens=2)
        assert big.value.status_code == 413
        # A burst that lands within one engine step: before, every arrival read the engine's
        # last report (nothing waiting) and all 12 were admitted. Admission counts what it
        # has let in, so one runs, one may wait, and the rest get 503 at once.
        admitted, refused_in_burst = asyncio.run(_burst(base, 12))
        assert 1 <= admitted <= 2 and refused_in_burst == 12 - admitted, admitted
        _wait_idle(base)
        # With one request running, more than zero waiting is too many: long streams are
        # admitted until the queue is seen non-empty, then a request gets 503 + Retry-After.
        long = dict(model=MODEL, prompt="hi", max_tokens=450, extra_body={"ignore_eos": True},
                    stream=True)
        streams, refused = [], None
        for _ in range(100):
            try:
                streams.append(keyed.completions.create(**long))  # returns at the headers
            except openai.APIStatusError as e:
                refused = e
                break
            time.sleep(0.05)
        assert refused is not None and refused.status_code == 503 and len(streams) >= 2
        assert refused.response.headers["retry-after"] == "1"
        for s in streams:
            s.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.mark.slow
def test_tenants_never_share_cached_prefixes(servers):
    """--cache-salt-per-api-key: a prompt cached under one API key is a miss under another
    (no hit, so nothing to time either); within a key, hits and cache_salt work as usual. Of
    several API keys none is the admin's."""
    base, _ = servers["tenants"]

    def cached(key: str, **extra) -> int:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
        usage = client.completions.create(model=MODEL, prompt=list(range(5, 45)), max_tokens=2,
                                          extra_body=extra).usage
        return usage.prompt_tokens_details.cached_tokens

    assert cached("alice-key") == 0
    assert cached("alice-key") == 32
    assert cached("bob-key") == 0       # the same prompt, another tenant: a miss
    assert cached("bob-key") == 32
    assert cached("alice-key", cache_salt="s") == 0   # a salt within the tenant's
    code, _ = _post(base, "/v1/completions", {"model": MODEL, "prompt": "hi"})
    assert code == 401
    for key, status in (("alice-key", 401), ("root-key", 200)):
        req = urllib.request.Request(f"{base}/v1/cache/reset", method="POST",
                                     headers={"Authorization": f"Bearer {key}"})
        try:
            code = urllib.request.urlopen(req, timeout=30).status
        except urllib.error.HTTPError as e:
            code = e.code
        assert code == status, key


@pytest.mark.slow
def test_a_request_past_its_timeout_is_aborted(servers):
    """--request-timeout 1: a request that would run longer is aborted in the engine and
    answered 504 (a stream: ends with an error event); short ones are served meanwhile."""
    base, _ = servers["tenants"]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="alice-key", max_retries=0)
    # 8 prompts x n=128 x 500 tokens: one such sequence takes 0.2 s offline on a Zen 3 and
    # 128 take 3.7 s, so 1024 cannot finish within the 1 s on any CPU we run on.
    long = dict(model=MODEL, prompt=["hi"] * 8, n=128, max_tokens=500,
                extra_body={"ignore_eos": True})
    with pytest.raises(openai.APIStatusError) as timed_out:
        client.completions.create(**long)
    assert timed_out.value.status_code == 504
    assert timed_out.value.body["code"] == "request_timeout"
    with pytest.raises(openai.APIError, match="request timeout"):
        list(client.completions.create(**long, stream=True))
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
    values = _metrics(base)
    assert values["openinfer:num_requests_running"] == 0
    assert values["openinfer:kv_cache_usage_perc"] == 0


@pytest.mark.slow
def test_priority_scheduling_orders_the_waiting_requests(servers):
    """--scheduling-policy priority, one sequence at a time: of two requests waiting behind
    a running one, the lower `priority` value runs first, whatever the arrival order."""
    base, _ = servers["priority"]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    finished: list[str] = []

    def run(name: str, priority: int, max_tokens: int) -> None:
        client.completions.create(model=MODEL, prompt=name, max_tokens=max_tokens,
                                  extra_body={"ignore_eos": True, "priority": priority})
        finished.append(name)

    with ThreadPoolExecutor(2) as pool:
        running = client.completions.create(model=MODEL, prompt="first", max_tokens=500,
                                            stream=True, extra_body={"ignore_eos": True})
        next(iter(running))  # it holds the one sequence slot
        # The lax request is the longer one: when the urgent one runs first, as it should,
        # it ends 64 steps before the lax one, more than a client thread's delay can reorder.
        early = pool.submit(run, "earlier, lax", 5, 64)
        deadline = time.monotonic() + 30
        while _metrics(base)["openinfer:num_requests_waiting"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        late = pool.submit(run, "later, urgent", 1, 4)
        while _metrics(base)["openinfer:num_requests_waiting"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert sum(1 for _ in running) > 0
        late.result(), early.result()
    assert finished == ["later, urgent", "earlier, lax"]
    # --metrics-engine-index labels every engine series of this server.
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    series = [line for line in text.splitlines() if line.startswith("openinfer:")]
    assert series and all('engine="3"' in line for line in series if "engine=" in line)
    assert any('engine="3"' in line for line in series)


@pytest.mark.slow
def test_metrics_move_and_dropped_streams_are_aborted(server, client):
    base, _ = server
    before = _metrics(base)
    client.completions.create(model=MODEL, prompt="count me", max_tokens=5,
                              extra_body={"ignore_eos": True})
    after = _metrics(base)
    assert after["openinfer:generation_tokens_total"] - before["openinfer:generation_tokens_total"] == 5
    assert after["openinfer:request_success_total[length]"] >= 1
    assert after["openinfer:time_to_first_token_seconds_count"] > before.get(
        "openinfer:time_to_first_token_seconds_count", 0)
    assert after["openinfer:e2e_request_latency_seconds_count"] >= 1
    assert "openinfer:kv_cache_usage_perc" in after and "openinfer:prefix_cache_hits_total" in after
    # The engine-core process froze its start-up heap out of the GC's passes (gc_heap.py).
    assert after["openinfer:gc_frozen_objects"] > 10_000

    # 50 clients read the start of a long stream, then hang up.
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "tell me a long story", "max_tokens": 400,
                       "ignore_eos": True, "stream": True})
    for _ in range(50):
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read1(64).startswith(b"data:")
        conn.close()
    def ended(m: dict, reason: str) -> float:
        key = f"openinfer:request_success_total[{reason}]"
        return m.get(key, 0) - before.get(key, 0)

    for _ in range(200):
        m = _metrics(base)
        if (m["openinfer:num_requests_running"] == 0 and m["openinfer:kv_cache_usage_perc"] == 0
                and ended(m, "abort") + ended(m, "length") >= 51):
            break
        time.sleep(0.1)
    assert m["openinfer:num_requests_running"] == 0 and m["openinfer:num_requests_waiting"] == 0
    assert m["openinfer:kv_cache_usage_perc"] == 0
    # Every dropped stream ended; nearly all as aborts (on a loaded machine a stream can
    # reach max_tokens before the server sees its client gone).
    assert ended(m, "abort") + ended(m, "length") >= 51  # + the first request
    assert ended(m, "abort") >= 40
    # ... and the server still answers.
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


def test_a_client_gone_before_a_non_streamed_answer_aborts_it(server):
    """A non-streamed completion has no byte to send before its end: a client that gives up
    first (its read timeout) aborts it, rather than leaving 128 x 480 tokens to be made for
    nobody, and the server keeps serving."""
    base, _ = server
    before = _metrics(base)
    body = {"model": MODEL, "prompt": "nobody waits for this", "n": 128, "max_tokens": 480,
            "temperature": 1, "seed": 1, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))

    def ended(m: dict, reason: str) -> float:
        key = f"openinfer:request_success_total[{reason}]"
        return m.get(key, 0) - before.get(key, 0)

    deadline = time.monotonic() + 30
    while (m := _metrics(base))["openinfer:num_requests_running"] > 0 or not ended(m, "abort"):
        assert time.monotonic() < deadline, "the engine went on generating"
        time.sleep(0.05)
    assert (ended(m, "abort"), ended(m, "length")) == (1, 0)
    assert m["openinfer:kv_cache_usage_perc"] == 0
    status, answer = _post(base, "/v1/completions", {"model": MODEL, "prompt": "hi",
                                                      "max_tokens": 2})
    assert status == 200 and answer["choices"]


@pytest.mark.slow
def test_anthropic_messages_and_streaming(server, offline):
    base, _ = server
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    tok = offline.get_tokenizer()
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    ids = tok.encode(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    expected = offline.generate([ids], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    args = dict(model=MODEL, max_tokens=8, system="Be brief.", extra_body={"temperature": 0},
                messages=[{"role": "user", "content": "Hello"}])
    message = client.messages.create(**args)
    assert message.content[0].text == expected.text
    # Anthropic counts cache reads apart from input_tokens.
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(ids)
    assert message.usage.output_tokens == len(expected.token_ids)
    sources = message.usage.prompt_tokens_by_source  # openinfer's extension
    assert sources["L1"] == message.usage.cache_read_input_tokens
    assert sum(sources.values()) == len(ids) and sources["computed"] == message.usage.input_tokens
    assert message.stop_reason == ("max_tokens" if expected.finish_reason == "length"
                                   else "end_turn")
    with client.messages.stream(**args) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == expected.text and final.stop_reason == message.stop_reason


@pytest.mark.slow
def test_chat_and_messages_caps_name_the_field_and_the_cap(server):
    base, _ = server
    many = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)
    code, body = _post(base, "/v1/chat/completions", {"model": MODEL, "messages": many})
    assert code == 400 and body["error"]["param"] == "messages"
    assert str(MAX_MESSAGES) in body["error"]["message"]
    code, body = _post(base, "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": many})
    assert code == 400 and str(MAX_MESSAGES) in body["error"]["message"]
    code, body = _post(base, "/v1/messages", {
        "model": MODEL, "max_tokens": 4, "messages": many[:1],
        "stop_sequences": ["x"] * (MAX_STOP + 1)})
    assert code == 400 and "stop_sequences" in body["error"]["message"]
    code, body = _post(base, "/v1/completions", {"model": MODEL, "prompt": "hi",
                                                 "n": MAX_N + 1})
    assert str(MAX_N) in body["error"]["message"]


@pytest.mark.slow
def test_anthropic_errors_have_anthropic_shape(server):
    base, _ = server
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}])
    code, body = _post(base, "/v1/messages", {"model": MODEL, "max_tokens": 10**6,
                                              "messages": [{"role": "user", "content": "hi"}]})
    assert code == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and "max" in body["error"]["message"]


@pytest.mark.slow
def test_malformed_json_is_a_400_that_names_no_param(server):
    """Not the decoder's byte offset taken for a field: where the JSON breaks, in words."""
    base, _ = server
    broken = b'{"model": "tiny", "prompt": "hi" "max_tokens": 2}'
    for path in ("/v1/completions", "/v1/chat/completions"):
        code, body = _post(base, path, broken)
        assert code == 400, body
        assert body["error"] == {"message": "invalid JSON in request body: Expecting ',' "
                                            "delimiter at line 1 column 34",
                                 "type": "invalid_request_error", "param": None, "code": None}
    code, body = _post(base, "/v1/messages", b'{"max_tokens": 4,\n "messages": [}')
    assert code == 400 and body["type"] == "error"
    assert body["error"] == {"type": "invalid_request_error", "message": "invalid JSON in "
                             "request body: Expecting value at line 2 column 15"}


@pytest.mark.slow
def test_a_prompt_too_long_says_context_length_exceeded_as_max_tokens_does(server):
    """Clients tell a context overflow from other 400s by this code: both causes carry it."""
    base, _ = server
    max_len = json.loads(urllib.request.urlopen(f"{base}/v1/models").read())["data"][0][
        "max_model_len"]
    too_long = list(range(5, 5 + max_len))
    for path, body, param in [
            ("/v1/completions", {"prompt": too_long, "max_tokens": 1}, "prompt"),
            ("/v1/completions", {"prompt": "hi", "max_tokens": max_len}, "max_tokens"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * max_len}],
                                      "max_tokens": 1}, "messages"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": max_len}, "max_tokens")]:
        code, answer = _post(base, path, {"model": MODEL, **body})
        assert code == 400, (body, answer)
        error = answer["error"]
        assert (error["code"], error["param"], error["type"]) == (
            "context_length_exceeded", param, "invalid_request_error"), error
        assert f"maximum context length is {max_len} tokens" in error["message"]
    # A prompt the request truncates to fit is served.
    code, ok = _post(base, "/v1/completions", {"model": MODEL, "prompt": too_long,
                                               "truncate_prompt_tokens": 8, "max_tokens": 1})
    assert code == 200 and ok["usage"]["prompt_tokens"] == 8


@pytest.mark.slow
def test_text_parts_are_served_and_an_image_is_refused_by_name(server, offline):
    """The demo template loops over content parts: text parts render as their text. The
    model reads text only: an image part or block is a 400 naming it, never dropped."""
    base, _ = server
    parts = [{"type": "text", "text": "What is a"}, {"type": "text", "text": " KV cache?"}]
    answers = []
    for content in (parts, "What is a KV cache?"):
        code, out = _post(base, "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": content}],
            "temperature": 0, "max_tokens": 6})
        assert code == 200, out
        answers.append((out["choices"][0]["message"]["content"], out["usage"]["prompt_tokens"]))
    assert answers[0] == answers[1]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    code, out = _post(base, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": [parts[0], image]}]})
    assert code == 400 and out["error"]["param"] == "messages.0.content.1", out
    assert out["error"]["message"].startswith("messages.0.content.1: image_url parts are not "
                                              "supported")
    code, out = _post(base, "/v1/messages", {
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}},
            {"type": "text", "text": "What is this?"}]}]})
    assert code == 400 and out["type"] == "error", out
    assert out["error"]["type"] == "invalid_request_error"
    assert out["error"]["message"].startswith("messages.0.content.0: image blocks are not "
                                              "supported")


def _health(base: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _kill_engine_core(proc: subprocess.Popen) -> None:
    core = subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "spawn_main"],
                          capture_output=True, text=True).stdout.split()
    assert len(core) == 1
    os.kill(int(core[0]), signal.SIGKILL)


def _wait_health(base: str, status: int, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        code, body = _health(base)
        if code == status:
            return body
        assert time.monotonic() < deadline, f"/health stayed {code}: {body}"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_dead_engine_gives_503_then_restarts(servers, offline, qwen3_checkpoint):
    """--restart-on-engine-failure --max-engine-restarts 1: the engine core killed under a
    stream ends that stream with an error event (no hang), /health says 503 while a new core
    starts, then the server answers again as before; killed a second time within the window,
    it is left dead and says so (503, engine_dead) rather than restarting forever. A router
    in front follows the new core's KV events, on the new ports it took."""
    base, proc = servers["dead_engine"]
    router, router_proc = start_router([base], qwen3_checkpoint)
    try:
        first_events = _kv_events(base)["endpoint"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                               timeout=30)
        stream = client.completions.create(model=MODEL, prompt="hi", max_tokens=400,
                                           extra_body={"ignore_eos": True}, stream=True)
        next(iter(stream))
        _wait_for(lambda: _indexed(router) >= 2)  # the router follows the stream's blocks
        _kill_engine_core(proc)
        # The open stream ends with an error event (the client raises it) instead of hanging.
        with pytest.raises(openai.APIError, match="engine"):
            list(stream)
        assert "restarting" in _wait_health(base, 503, 30)["reason"]
        assert _wait_health(base, 200)["engine_restarts"] == 1
        prompt = [7, 300, 41, 9, 12] * 3
        want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=8))
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                           temperature=0)
        assert answer.choices[0].text == want[0].outputs[0].text
        # The new core took new event ports (tcp://127.0.0.1:*); the router subscribed
        # there, and its index started over: the answer's one full block, no stale one.
        assert _kv_events(base)["endpoint"] != first_events
        _wait_for(lambda: _indexed(router) == 1, show=lambda: admin_workers(router))

        _kill_engine_core(proc)
        body, deadline = _wait_health(base, 503, 30), time.monotonic() + 30
        # The restarter gives up at once (2 failures in the window), and that verdict is
        # final: it has returned, so no backoff is left to wait out.
        while "not restarted" not in body["reason"]:
            assert "restarting" not in body["reason"] and time.monotonic() < deadline, body
            time.sleep(0.05)
            code, body = _health(base)
            assert code == 503, body
        assert body["engine_restarts"] == 1, body
        code, body = _post(base, "/v1/completions", {"model": MODEL, "prompt": "hi"})
        assert code == 503 and body["error"]["code"] == "engine_dead"
    finally:
        stop(router_proc)
        proc.kill()
        proc.wait()


def _kv_events(base: str) -> dict:
    return json.loads(urllib.request.urlopen(f"{base}/kv_events", timeout=30).read())


def _indexed(router: str) -> int:
    """The blocks the router's index holds for its one replica."""
    return admin_workers(router)[0]["indexed_blocks"]


def _wait_for(condition, timeout_s: float = 30, show=lambda: None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out: {show()}"
        time.sleep(0.05)


def test_idle_connections_stay_open_longer_than_clients_keep_them(servers):
    """A connection idle for 6 s still takes a request (the default keep-alive outlasts the
    5 s after which httpx, hence the OpenAI SDK, stops reusing one: so the client always
    closes first, and no request is sent on a connection the server is just closing);
    --timeout-keep-alive 2 closes it."""
    def connect(name: str) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(servers[name][0].removeprefix("http://"), timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().read() is not None
        return conn

    default, short = connect("shared"), connect("priority")
    time.sleep(6)
    default.request("GET", "/health")
    assert default.getresponse().status == 200
    with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
        short.request("GET", "/health")
        short.getresponse()
    default.close()
    short.close()
