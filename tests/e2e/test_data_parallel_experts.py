"""Data-parallel attention with expert parallelism, through real servers: two engines, each
with its own requests and KV cache, hold half of a mixture-of-experts model's experts each
and step together (an engine without requests runs its experts for the other's tokens).
Started as `serve --data-parallel-size 2 --enable-expert-parallel` (the two ranks and the
cache-aware router), asked through the router or directly, they answer what one engine
holding the whole model answers, while EPLB moves experts between them."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest
from conftest import build_checkpoint
from server_process import ADMIN, MODEL, admin_workers, metrics, start_server, stop

from openinfer import LLM, SamplingParams
from openinfer.kv.block_hash import extend_block_hashes
from openinfer.transfer.file_store import SUFFIX, model_fingerprint

EPLB = json.dumps({"window_size": 3, "step_interval": 4, "num_redundant_experts": 2})
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})


def _complete(base: str, prompt: list[int]) -> str:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                       extra_body={"ignore_eos": True})
    return answer.choices[0].text


def test_two_data_parallel_ranks_share_the_experts_and_answer_as_one(tmp_path, tokenizer):
    checkpoint = build_checkpoint(tmp_path, "Qwen3MoeForCausalLM", tokenizer, extra_config=dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
        norm_topk_prob=True))
    prompts = [[7, 300, 41, 9, 12] * 3, [500, 3, 77], [12, 13, 14, 15] * 5, [900, 901] * 4,
               [44] * 9, [5, 6, 7, 8, 9, 10]]
    offline = LLM(str(checkpoint), progress=False)
    want = [o.outputs[0].text for o in offline.generate(
        prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))]

    store = tmp_path / "store"
    router, proc = start_server(checkpoint, "--data-parallel-size", "2",
                                "--enable-expert-parallel", "--enable-eplb", "--eplb-config", EPLB,
                                "--kv-host-memory", "4MiB", "--kv-store-dir", str(store),
                                "--speculative-config", NGRAM)
    try:
        ranks = [w["url"] for w in admin_workers(router)]
        assert len(ranks) == 2
        # One rank asked alone: the other, idle, still runs its experts for these tokens.
        assert _complete(ranks[0], prompts[0]) == want[0]
        assert _complete(ranks[1], prompts[1]) == want[1]
        served = [metrics(rank)["openinfer:request_success_total[length]"] for rank in ranks]
        with ThreadPoolExecutor(len(prompts)) as pool:  # both ranks busy at once
            got = list(pool.map(lambda p: _complete(router, p), prompts))
        assert got == want
        for rank, before in zip(ranks, served):
            values = metrics(rank)
            assert values["openinfer:request_success_total[length]"] > before  # each took some
            assert values["openinfer:eplb_rearrangements_total"] >= 2
        assert sum(metrics(rank)["openinfer:eplb_experts_moved_total"] for rank in ranks) > 0
        # n-gram drafts were verified (one forward pass a step: the ranks stay in lockstep)
        assert sum(metrics(rank).get("openinfer:spec_decode_num_draft_tokens_total", 0)
                   for rank in ranks) > 0

        # The KV tiers under the group: rank 0 forgets its device and host caches and reads
        # its 20-token prompt's first block back from the file store (written behind the
        # answers, by whichever rank served it), while rank 1 idles through the collectives.
        _complete(ranks[0], prompts[2])  # (rank 0 holds it now, whoever served it first)
        hashes: list[bytes] = []
        extend_block_hashes(hashes, prompts[2], 16, None)
        name = hashes[0].hex()
        block = store / model_fingerprint(checkpoint)[:16] / name[:2] / f"{name}{SUFFIX}"
        deadline = time.monotonic() + 30
        while not block.is_file():
            assert time.monotonic() < deadline, "the block never reached the file store"
            time.sleep(0.05)
        urllib.request.urlopen(urllib.request.Request(f"{ranks[0]}/v1/cache/reset",
                                                      method="POST", headers=ADMIN), timeout=30)
        l3 = metrics(ranks[0]).get("openinfer:prefix_cache_hits_by_tier_total[L3]", 0)
        assert _complete(ranks[0], prompts[2]) == want[2]
        assert metrics(ranks[0])["openinfer:prefix_cache_hits_by_tier_total[L3]"] == l3 + 16

        # Rank 1's engine dies: rank 0's next lockstep collective fails (it polls even when
        # idle), so both ranks turn unhealthy at once, and the router stops sending them
        # traffic, rather than anyone waiting on a group that cannot step.
        engines = [_engine_core_of_rank(proc.pid, rank) for rank in (0, 1)]
        engines[1].kill()
        deadline = time.monotonic() + 60
        while any(_health(rank) != 503 for rank in ranks):
            assert time.monotonic() < deadline, [_health(rank) for rank in ranks]
            time.sleep(0.2)
        with pytest.raises(openai.APIStatusError) as failed:
            _complete(router, prompts[0])
        assert failed.value.status_code == 503
    finally:
        stop(proc)
    _, alive = psutil.wait_procs(engines, timeout=30)
    assert not alive, "rank 0's engine outlived the group"


def _engine_core_of_rank(launcher_pid: int, rank: int) -> psutil.Process:
    """The engine-core process of data-parallel rank ``rank``'s server."""
    for server in psutil.Process(launcher_pid).children(recursive=True):
        cmdline = server.cmdline()
        if "--data-parallel-rank" in cmdline and \
                cmdline[cmdline.index("--data-parallel-rank") + 1] == str(rank):
            return next(p for p in server.children()
                        if "resource_tracker" not in " ".join(p.cmdline()))
    raise AssertionError(f"no server of rank {rank}")


def _health(base: str) -> int:
    try:
        return httpx.get(f"{base}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0
