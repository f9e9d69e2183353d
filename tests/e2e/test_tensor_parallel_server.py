"""`openinfer serve --tensor-parallel-size 2` through the real server: the answers of one
rank, and a rank that dies turns the server unhealthy at once, ends the engine's
processes and fails requests with a clear error (no hang, no orphan); with
`--enable-expert-parallel --enable-eplb`, a mixture-of-experts model's answers stay those of
one rank while its experts are moved between the ranks; with
`--prefill-context-parallel-size 2`, long prompts split over two ranks answer as one rank."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import psutil
import pytest
from conftest import build_checkpoint
from server_process import ADMIN, MODEL, metrics, start_server, stop

from openinfer import LLM, SamplingParams
from openinfer.executor.nodes import RemoteRanks


def _engine_processes(server_pid: int) -> list[psutil.Process]:
    """The server's live descendants, but multiprocessing's resource tracker."""
    live = []
    for p in psutil.Process(server_pid).children(recursive=True):
        try:
            if (p.status() != psutil.STATUS_ZOMBIE
                    and "resource_tracker" not in " ".join(p.cmdline())):
                live.append(p)
        except psutil.NoSuchProcess:  # (a zombie's command line is gone too)
            pass
    return live


def test_tensor_parallel_server_answers_and_a_dead_rank_makes_it_unhealthy(qwen3_checkpoint,
                                                                           tmp_path):
    """Two ranks answer as one, with the KV tiers on (each rank's share of a block in its
    own host pool and files); one rank killed turns the server unhealthy."""
    prompts = [[7, 300, 41, 9, 12] * 8, [500, 3, 77]]
    offline = LLM(str(qwen3_checkpoint), progress=False)
    want = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=10,
                                                    ignore_eos=True))
    base, proc = start_server(qwen3_checkpoint, "--tensor-parallel-size", "2",
                              "--kv-host-memory", "4MiB", "--kv-store-dir", str(tmp_path))
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        for prompt, expected in zip(prompts, want):
            answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                               temperature=0, extra_body={"ignore_eos": True})
            assert answer.choices[0].text == expected.outputs[0].text
        # The 40-token prompt's first two blocks, read back from both ranks' files once
        # the device and host tiers forget them.
        deadline = time.monotonic() + 30
        while len(list(tmp_path.rglob("*.kvblock"))) < 2 * 3:  # written behind the answers:
            assert time.monotonic() < deadline, list(tmp_path.rglob("*"))  # 49 tokens' 3
            time.sleep(0.05)                                            # blocks, per rank
        _reset_cache(base)
        again = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=10,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert again.choices[0].text == want[0].outputs[0].text
        assert again.usage.prompt_tokens_details.cached_tokens == 32
        assert metrics(base)["openinfer:prefix_cache_hits_by_tier_total[L3]"] == 32
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model=MODEL, prompt=prompts[0], max_tokens=10, temperature=0, stream=True,
            extra_body={"ignore_eos": True}))
        assert streamed == want[0].outputs[0].text

        engine = _engine_processes(proc.pid)  # the engine core and its two ranks
        ranks = [p for p in engine if p.ppid() != proc.pid]
        assert len(engine) == 3 and len(ranks) == 2
        ranks[1].kill()
        # The next request finds the dead rank: a clear error, and the server turns unhealthy.
        with pytest.raises(openai.APIStatusError) as failed:
            client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=50,
                                      extra_body={"ignore_eos": True})
        assert failed.value.status_code in (500, 503)
        _wait_unhealthy(base, "tensor-parallel rank")
        # (Polled, not psutil.wait_procs: that waits on the killed rank's zombie too, which
        # an init that reaps nothing keeps.)
        deadline = time.monotonic() + 30
        while _engine_processes(proc.pid):
            assert time.monotonic() < deadline, "an engine process outlived its dead rank"
            time.sleep(0.1)
        assert proc.poll() is None  # the API process still answers (503s) until stopped
    finally:
        stop(proc)


def _reset_cache(base: str) -> None:
    urllib.request.urlopen(urllib.request.Request(f"{base}/v1/cache/reset", method="POST",
                                                  headers=ADMIN), timeout=30)


def test_expert_parallel_server_with_eplb_answers_as_one_rank(tmp_path, tokenizer):
    checkpoint = build_checkpoint(tmp_path, "Qwen3MoeForCausalLM", tokenizer, extra_config=dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
        norm_topk_prob=True))
    prompts = [[7, 300, 41, 9, 12] * 3, [500, 3, 77], [12, 13, 14, 15] * 5]
    want = _offline_texts(checkpoint, prompts, 24)
    eplb = json.dumps({"window_size": 3, "step_interval": 4, "num_redundant_experts": 2})
    base, proc = start_server(checkpoint, "--tensor-parallel-size", "2",
                              "--enable-expert-parallel", "--enable-eplb", "--eplb-config", eplb)
    try:
        assert _server_texts(base, prompts, 24) == want
        values = metrics(base)
        assert values["openinfer:eplb_rearrangements_total"] >= 4
        assert values["openinfer:eplb_experts_moved_total"] > 0
        assert values["openinfer:eplb_bytes_moved_total"] > 0
    finally:
        stop(proc)


def test_context_parallel_server_answers_as_one_rank(qwen3_checkpoint):
    prompts = [list(range(40, 140)), [500, 3, 77] * 20]  # split chunks, then decodes
    want = _offline_texts(qwen3_checkpoint, prompts, 8)
    base, proc = start_server(qwen3_checkpoint, "--prefill-context-parallel-size", "2")
    try:
        assert _server_texts(base, prompts, 8) == want
    finally:
        stop(proc)


def _offline_texts(checkpoint, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """One in-process engine's greedy answers: what the split engines must give."""
    outs = LLM(str(checkpoint), progress=False).generate(
        prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


def _server_texts(base: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """The server's greedy answers to the prompts, sent as one batched request."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    answer = client.completions.create(model=MODEL, prompt=prompts, max_tokens=max_tokens,
                                       temperature=0, extra_body={"ignore_eos": True})
    texts = {choice.index: choice.text for choice in answer.choices}
    return [texts[i] for i in range(len(prompts))]


def test_tensor_parallel_over_two_nodes_answers_as_one_rank(qwen3_checkpoint, tmp_path,
                                                             monkeypatch):
    """`serve -tp 2 --nnodes 2` (node 0: the server and rank 0) with `serve --node-rank 1`
    (rank 1, headless): the answers of one rank, with the file store on a directory both
    nodes see (each rank's share in its own files, read back once L1 and L2 forget); the
    headless node's rank dying turns the server unhealthy, and node 0's engine ends (no
    orphan). Both nodes are this machine."""
    prompts = [[7, 300, 41, 9, 12] * 8, [500, 3, 77]]
    want = _offline_texts(qwen3_checkpoint, prompts, 8)
    store = tmp_path / "store"
    port = _free_port_pair()
    nodes = ["--nnodes", "2", "--master-port", str(port)]
    monkeypatch.setenv("OPENINFER_NODE_SECRET", "test-secret")
    with open(tmp_path / "node1.log", "w") as log:
        headless = subprocess.Popen(  # started first: it waits for node 0
            [sys.executable, "-m", "openinfer", "serve", "--model", str(qwen3_checkpoint),
             "-tp", "2", *nodes, "--node-rank", "1", "--headless"], stdout=log,
            stderr=subprocess.STDOUT)
    try:
        base, proc = start_server(qwen3_checkpoint, "-tp", "2", *nodes, "--kv-host-memory",
                                  "4MiB", "--kv-store-dir", str(store))
        try:
            assert _server_texts(base, prompts, 8) == want
            # The 40-token prompt's first two blocks, a file per rank, read back from both.
            deadline = time.monotonic() + 30
            while len(list(store.rglob("*.kvblock"))) < 2 * 2:
                assert time.monotonic() < deadline, list(store.rglob("*"))
                time.sleep(0.05)
            assert not list(store.rglob(".probe-*")), "a start-up probe was left behind"
            _reset_cache(base)
            assert _server_texts(base, prompts[:1], 8) == want[:1]
            assert metrics(base)["openinfer:prefix_cache_hits_by_tier_total[L3]"] == 32
            remote = [p for p in psutil.Process(headless.pid).children()
                      if "resource_tracker" not in " ".join(p.cmdline())]
            assert len(remote) == 1
            remote[0].kill()
            with pytest.raises(openai.APIStatusError):
                _server_texts(base, prompts, 8)
            _wait_unhealthy(base, "tensor-parallel rank 1 (another node) died")
            assert headless.wait(timeout=30) != 0, "the headless node outlived its rank"
            deadline = time.monotonic() + 30
            while _engine_processes(proc.pid):
                assert time.monotonic() < deadline, "node 0's engine outlived the failure"
                time.sleep(0.2)
        finally:
            stop(proc)
    finally:
        if headless.poll() is None:
            headless.kill()
        headless.wait(timeout=10)


def test_a_prefill_instance_over_two_nodes_lends_each_share_from_its_node(qwen3_checkpoint,
                                                                         monkeypatch):
    """Disaggregation with a prefill instance's ranks on two nodes: each rank lends its share
    of the blocks from its own node (node 1's on its $OPENINFER_KV_TRANSFER_HOST, 127.0.0.2
    here), the answer names each rank's host (remote_rank_hosts), and each rank of a TP=2
    decode instance pulls its share from there: every block pulled, the colocated tokens.

    Node 1's connection is registered late here, a second after its rank has reported its
    shard loaded: node 0's rank has loaded by then too, and its report, read while the join
    is still pending, is kept for the start's gather (it once failed the start)."""
    monkeypatch.setattr(RemoteRanks, "complete", property(_registered_late))
    prompts = [[(7 * i + j) % 900 + 3 for j in range(40)] for i in range(2)]  # 2 full blocks
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(str(qwen3_checkpoint), progress=False)
                .generate(prompts, SamplingParams(**greedy))]
    port = _free_port_pair()
    nodes = dict(nnodes=2, master_port=port)
    monkeypatch.setenv("OPENINFER_NODE_SECRET", "test-secret")
    headless = subprocess.Popen(
        [sys.executable, "-m", "openinfer", "serve", "--model", str(qwen3_checkpoint), "-tp", "2",
         "--nnodes", "2", "--master-port", str(port), "--node-rank", "1", "--headless"],
        env={**os.environ, "OPENINFER_KV_TRANSFER_HOST": "127.0.0.2"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prefill = decode = None
    try:
        prefill = LLM(str(qwen3_checkpoint), progress=False, tensor_parallel_size=2,
                      kv_role="prefill", **nodes)
        decode = LLM(str(qwen3_checkpoint), progress=False, tensor_parallel_size=2,
                     kv_role="decode")
        lent = prefill.generate(prompts, SamplingParams(
            temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
        params = [o.kv_transfer_params for o in lent]
        assert all(p["remote_rank_hosts"] == ["127.0.0.1", "127.0.0.2"] for p in params), params
        outs = decode.generate(prompts, [SamplingParams(**greedy, kv_transfer_params=p)
                                         for p in params])
        assert [o.outputs[0].token_ids for o in outs] == expected
        core = decode.engine.core
        assert core.scheduler.num_remote_blocks_pulled == 2 * 2
        assert core.stats()["kv_remote_pull_failures"] == 0
    finally:
        for llm in (prefill, decode):
            if llm is not None:
                llm.engine.core.shutdown()
        try:
            headless.wait(timeout=30)  # it ends with node 0's engine
        finally:
            if headless.poll() is None:
                headless.kill()


def _registered_late(remote: RemoteRanks) -> bool:
    if len(remote.conns) < len(remote.expected) or not all(
            c.poll() for c in remote.conns.values()):
        return False
    seen = remote.__dict__.setdefault("_seen_at", time.monotonic())
    return time.monotonic() > seen + 1.0


def _wait_unhealthy(base: str, reason: str) -> None:
    """Until /health answers 503 with ``reason`` in its body (30 s at most)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{base}/health", timeout=5)
        except urllib.error.HTTPError as e:
            assert e.code == 503
            assert reason in json.loads(e.read())["reason"]
            return
        assert time.monotonic() < deadline, "the server stayed healthy"
        time.sleep(0.2)


def _free_port_pair() -> int:
    """A port P with P + 1 free too (a node group's rendezvous and the engine's calls)."""
    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports")
