"""The engine core in its own process, driven over ZMQ by the asyncio client."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from server_process import process_running

from openinfer import LLM, SamplingParams
from openinfer.engine.core_client import EngineCoreClient, EngineDeadError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
PROMPTS = [[5, 9, 200, 31], list(range(40, 90)), [7] * 19]


async def _collect(queue: asyncio.Queue) -> list[int]:
    tokens: list[int] = []
    while True:
        out = await asyncio.wait_for(queue.get(), timeout=120)
        if isinstance(out, Exception):
            raise out
        tokens += out.new_token_ids
        assert out.new_logprobs is not None and out.new_token_ids[0] in out.new_logprobs[0]
        if out.finish_reason is not None:
            return tokens


@pytest.mark.slow
def test_core_process_serves_aborts_and_shuts_down(qwen3_checkpoint):
    expected = [o.outputs[0].token_ids for o in LLM(str(qwen3_checkpoint), progress=False)
                .generate(PROMPTS, GREEDY)]

    async def scenario() -> None:
        client = EngineCoreClient({"model": str(qwen3_checkpoint), "kv_cache_memory": 1 << 24})
        await client.start()
        try:
            assert client.info["max_model_len"] == 512
            assert client.info["compute_info"]["dtype"] == "float32"
            assert set(client.info["compute_info"]) == {
                "dtype", "gemm", "cpu_capability", "huge_pages", "attention", "attention_bf16_dot",
                "cpu_allocator_cache", "cuda_graphs", "experts"}
            queues = [client.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
            # A long request, aborted after its first tokens, frees its blocks in the core.
            doomed = client.add_request("doomed", [1, 2, 3], SamplingParams(
                temperature=0, max_tokens=400, ignore_eos=True))
            assert (await asyncio.wait_for(doomed.get(), 120)).new_token_ids
            client.abort(["doomed"])
            got = await asyncio.gather(*(_collect(q) for q in queues))
            assert got == expected
            for _ in range(200):
                if client.stats.get("num_running") == 0 and client.stats["kv_cache_usage"] == 0:
                    break
                await asyncio.sleep(0.05)
            # The core ended it live (it did not run to its 400 tokens first).
            assert client.stats["num_aborted"] == 1
            assert client.stats["num_running"] == 0 and client.stats["num_waiting"] == 0
            assert client.stats["kv_cache_usage"] == 0
            assert client.num_unfinished == 0
        finally:
            await client.shutdown()
        assert not client._process.is_alive()

    asyncio.run(scenario())


def test_core_process_startup_failure_is_reported(tmp_path):
    async def scenario() -> None:
        (tmp_path / "empty").mkdir()
        client = EngineCoreClient({"model": str(tmp_path / "empty")})
        with pytest.raises(EngineDeadError, match="no config.json"):
            await client.start()
        await client.shutdown()

    asyncio.run(scenario())


FRONT_END = """
import asyncio, sys
from openinfer.engine.core_client import EngineCoreClient

async def main():
    client = EngineCoreClient({"model": sys.argv[1]})
    starting = asyncio.create_task(client.start())
    while client._process is None:
        await asyncio.sleep(0.01)
    print(client._process.pid, flush=True)
    await starting
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_a_front_end_killed_during_the_load_leaves_no_engine_core(qwen3_checkpoint):
    front = subprocess.Popen([sys.executable, "-c", FRONT_END, str(qwen3_checkpoint)],
                             stdout=subprocess.PIPE, text=True)
    core_pid = int(front.stdout.readline())
    front.kill()  # while the core is still loading (or just ready): no chance to say goodbye
    front.wait()
    deadline = time.monotonic() + 15
    while process_running(core_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not process_running(core_pid), "the engine core outlived its front end"


def test_the_cli_imports_no_torch():
    """`openinfer serve` starts its engine-core interpreter before importing the engine, so
    that the two import torch side by side (openinfer.engine.core_launch): the CLI module and
    the package itself must not import it."""
    probe = ("import sys, openinfer.cli; "
             "print(sorted({'torch', 'transformers', 'fastapi'} & set(sys.modules)))")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr


def test_a_refused_option_is_said_once_and_the_waiting_core_exits(qwen3_checkpoint):
    """The core's interpreter is started before the options are checked; one the engine
    refuses is reported once, by the front end, and that interpreter exits with it."""
    mark = f"openinfer-test-{uuid.uuid4()}"
    res = subprocess.run(
        [sys.executable, "-m", "openinfer.cli", "serve", "--model", str(qwen3_checkpoint),
         "--port", "0", "--max-num-seqs", "0"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OPENINFER_TEST_MARK": mark})
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("max_num_seqs must be >= 1") == 1 and "Traceback" not in res.stderr
    deadline = time.monotonic() + 15
    while _marked_processes(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _marked_processes(mark), "the engine-core interpreter outlived its front end"


def _marked_processes(mark: str) -> list[int]:
    """Live processes whose environment carries ``OPENINFER_TEST_MARK=mark``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if f"OPENINFER_TEST_MARK={mark}".encode() in environ.split(b"\0"):
                found.append(int(entry.name))
    return found
