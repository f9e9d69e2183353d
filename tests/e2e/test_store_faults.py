"""The file store (L3) under disk faults, through the real server: a disk that fills up,
files truncated and corrupted under it, the disk made read-only, the directory removed.
Serving goes on with the answers of the plain path, nothing bad is loaded, no partial file
is left behind, and the counters say what happened."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from server_process import ADMIN, MODEL, metrics, start_server, stop

from openinfer import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _prompts(first: int, count: int) -> list[list[int]]:
    """Distinct 40-token prompts (two full blocks each, never shared with another)."""
    return [[100 + i] + list(range(200 + 3 * i, 239 + 3 * i)) for i in range(first, first + count)]


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs: room for about a dozen of the test model's blocks."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"this machine does not let the test mount a tmpfs: {mounted.stderr}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def _block_files(store: Path) -> list[Path]:
    return sorted(store.glob("*/*/*.kvblock"))


def _leftover_temporaries(store: Path, timeout_s: float = 10) -> list[Path]:
    """Temporary files still there once the store's writes have had time to end."""
    deadline = time.monotonic() + timeout_s
    while (left := list(store.glob("*/*/.*.tmp"))) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _wait_for(base: str, name: str, above: float, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while (values := metrics(base)).get(name, 0) <= above:
        assert time.monotonic() < deadline, f"{name} stayed at {values.get(name, 0)}"
        time.sleep(0.1)
    return values


@pytest.mark.slow
def test_store_faults_lose_cache_entries_never_requests(qwen3_checkpoint, small_disk):
    prompts = _prompts(0, 40)
    offline = LLM(str(qwen3_checkpoint), progress=False)
    expected = [out.outputs[0].text for out in offline.generate(prompts, GREEDY)]
    store = small_disk / "store"
    base, proc = start_server(qwen3_checkpoint, "--kv-store-dir", str(store),
                              "--kv-store-bytes", str(1 << 30))  # the disk fills first
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)

    def answers(indices) -> list[str]:
        return [client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=6,
                                          temperature=0, extra_body={"ignore_eos": True})
                .choices[0].text for i in indices]

    def reset_device_and_host() -> None:
        req = urllib.request.Request(f"{base}/v1/cache/reset", method="POST", headers=ADMIN)
        assert json.loads(urllib.request.urlopen(req, timeout=30).read())["reset"]

    try:
        # 1. The disk fills up (ENOSPC): every request is answered; the refused writes are
        #    counted and leave no partial file.
        assert answers(range(16)) == expected[:16]
        full = _wait_for(base, "openinfer:kv_store_write_failures_total", 0)
        assert _leftover_temporaries(store) == []
        written = _block_files(store)
        assert 4 <= len(written) < 32  # some of the 32 prompt blocks fitted, not all

        # 2. Every file truncated or corrupted under the server: none is loaded (the
        #    answers are the plain path's), each one read is counted and deleted.
        corrupted = {}
        for i, path in enumerate(written):
            data = path.read_bytes()
            corrupted[path] = (data[:len(data) // 2] if i % 2 else
                               data[:-100] + bytes(b ^ 0xFF for b in data[-100:]))
            path.write_bytes(corrupted[path])
        reset_device_and_host()
        assert answers(range(16)) == expected[:16]
        _wait_for(base, "openinfer:kv_store_read_failures_total", 0)
        deadline = time.monotonic() + 30
        while True:  # each file read was refused and deleted (then maybe written afresh)
            values = metrics(base)
            touched = sum(not p.exists() or p.read_bytes() != bad for p, bad in corrupted.items())
            if touched == values["openinfer:kv_store_read_failures_total"]:
                break
            assert time.monotonic() < deadline, (touched, values)
            time.sleep(0.1)
        assert values["openinfer:prefix_cache_hits_by_tier_total[L3]"] == \
            full.get("openinfer:prefix_cache_hits_by_tier_total[L3]", 0)

        # 3. The disk made read-only: requests are served, writes fail and are counted.
        subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
        failures = metrics(base)["openinfer:kv_store_write_failures_total"]
        assert answers(range(16, 24)) == expected[16:24]
        _wait_for(base, "openinfer:kv_store_write_failures_total", failures)
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)

        # 4. The directory removed while serving: requests are served, the store makes its
        #    directories again and its new files are hits after the other tiers forget.
        shutil.rmtree(store)
        assert answers(range(24, 28)) == expected[24:28]
        deadline = time.monotonic() + 30
        while len(_block_files(store)) < 8:
            assert time.monotonic() < deadline, "the store did not write again"
            time.sleep(0.1)
        reset_device_and_host()
        hits = metrics(base).get("openinfer:prefix_cache_hits_by_tier_total[L3]", 0)
        assert answers(range(24, 28)) == expected[24:28]
        final = metrics(base)
        assert final["openinfer:prefix_cache_hits_by_tier_total[L3]"] >= hits + 4 * 32
        assert final["openinfer:num_requests_running"] == 0
        assert final["openinfer:kv_cache_usage_perc"] == 0
        assert _leftover_temporaries(store) == []
    finally:
        stop(proc)
