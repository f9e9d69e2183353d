"""KV tiers end to end: host memory (L2) and the file store (L3) give the plain path's tokens."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import pytest
from kv_pages import assert_same_pages, prompt_pages

from openinfer import LLM, SamplingParams
from openinfer.kv.block_hash import extend_block_hashes
from openinfer.outputs import PromptSources
from openinfer.transfer.file_store import MAGIC, SUFFIX

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
MiB = 1024**2


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(n)]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def plain(qwen3_checkpoint) -> LLM:
    return LLM(str(qwen3_checkpoint), enable_prefix_caching=False, progress=False)


def test_device_evictions_are_served_from_host_memory(qwen3_checkpoint, plain):
    # A device pool of 12 blocks of 16 tokens: each 70-token prompt needs 5, so a later
    # prompt evicts an earlier one, whose blocks come back from the host tier.
    llm = LLM(str(qwen3_checkpoint), kv_cache_memory=12 * 16 * 2 * 2 * 2 * 16 * 4,
              max_model_len=96, kv_host_memory=4 * MiB, progress=False)
    core = llm.engine.core
    assert core.kv.num_blocks == 12
    prompts = _prompts(4, 70, seed=1)
    expected = _tokens(plain.generate(prompts, GREEDY))
    first = llm.generate(prompts, GREEDY)
    assert _tokens(first) == expected
    assert all(o.prompt_sources == PromptSources(computed=70) for o in first)
    again = llm.generate(prompts, GREEDY)   # the first ones were evicted from the device
    assert _tokens(again) == expected
    assert all(o.num_cached_tokens == 64 for o in again)
    assert core.kv.hit_tokens_by_tier["L2"] > 0
    # Each request says where its prompt came from; together, what the counters say.
    sources = [o.prompt_sources for o in again]
    assert all(s.l1 + s.l2 == 64 and s.computed == 6 and s.l3 == s.pulled == 0 for s in sources)
    assert sum(s.l2 for s in sources) == core.kv.hit_tokens_by_tier["L2"]
    assert sum(s.l1 for s in sources) == core.kv.hit_tokens_by_tier["L1"]
    assert core.executor.worker.kv.mover.stats.bytes["host_to_device"] > 0
    core.check_integrity()
    # Each reloaded block lands in its place in the table: a prompt evicted from the device
    # (15 blocks of other prompts through the 12) comes back from host memory whole.
    (prompt,) = _prompts(1, 70, seed=9)
    llm.generate([prompt], GREEDY)
    llm.generate(_prompts(3, 70, seed=10), GREEDY)
    from_host = core.kv.hit_tokens_by_tier["L2"]
    assert_same_pages(prompt_pages(llm, prompt), prompt_pages(plain, prompt))
    assert core.kv.hit_tokens_by_tier["L2"] - from_host == 64


def test_file_store_hits_across_engines_and_processes(qwen3_checkpoint, plain, tmp_path):
    store = tmp_path / "store"
    prompts = _prompts(3, 70, seed=2)
    expected = _tokens(plain.generate(prompts, GREEDY))
    # Another process fills the store ...
    writer = (f"from openinfer import LLM, SamplingParams; import json\n"
              f"llm = LLM({str(qwen3_checkpoint)!r}, kv_store_dir={str(store)!r}, progress=False)\n"
              f"out = llm.generate({prompts!r}, SamplingParams(temperature=0, max_tokens=8, "
              f"ignore_eos=True))\n"
              f"llm.engine.core.shutdown()\n"
              f"print(json.dumps([o.outputs[0].token_ids for o in out]))\n")
    proc = subprocess.run([sys.executable, "-c", writer], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == expected
    files = sorted(store.rglob(f"*{SUFFIX}"))
    assert len(files) == 3 * 4 and not list(store.rglob("*.tmp"))
    # ... and this one, starting cold, hits it, each block in its place in the table.
    llm = LLM(str(qwen3_checkpoint), kv_store_dir=str(store), progress=False)
    assert_same_pages(prompt_pages(llm, prompts[0]), prompt_pages(plain, prompts[0]))
    assert llm.engine.core.kv.hit_tokens_by_tier["L3"] == 64
    outs = llm.generate(prompts, GREEDY)  # the first from the device now, the others from L3
    assert _tokens(outs) == expected
    assert [o.num_cached_tokens for o in outs] == [64, 64, 64]
    assert llm.engine.core.kv.hit_tokens_by_tier["L3"] == 3 * 64
    llm.engine.core.shutdown()


def test_bad_store_files_are_deleted_never_loaded(qwen3_checkpoint, plain, tmp_path):
    store = tmp_path / "store"
    prompts = _prompts(3, 40, seed=3)  # two full blocks each
    expected = _tokens(plain.generate(prompts, GREEDY))
    llm = LLM(str(qwen3_checkpoint), kv_store_dir=str(store), progress=False)
    llm.generate(prompts, GREEDY)
    llm.engine.core.shutdown()
    first_hashes, first_blocks = [], []  # the file of each prompt's first block
    for prompt in prompts:
        hashes: list[bytes] = []
        extend_block_hashes(hashes, prompt, 16)
        first_hashes.append(hashes[0])
        first_blocks.append(next(store.rglob(f"{hashes[0].hex()}{SUFFIX}")))
    truncated, flipped, foreign = first_blocks
    truncated.write_bytes(truncated.read_bytes()[:-100])
    data = bytearray(flipped.read_bytes())
    data[-10] ^= 0xFF
    flipped.write_bytes(bytes(data))
    data = foreign.read_bytes()
    header_len = int.from_bytes(data[len(MAGIC):len(MAGIC) + 4], "little")
    start = len(MAGIC) + 4
    header = json.loads(data[start:start + header_len])
    header["layout"]["model_fingerprint"] = "0" * 64   # a block of another model
    new_header = json.dumps(header).encode()
    foreign.write_bytes(MAGIC + len(new_header).to_bytes(4, "little") + new_header
                        + data[start + header_len:])

    fresh = LLM(str(qwen3_checkpoint), kv_store_dir=str(store), progress=False)
    outs = fresh.generate(prompts, GREEDY)
    assert _tokens(outs) == expected
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]  # their chains break at block 0
    file_store = fresh.engine.core.executor.worker.kv.mover.store
    assert fresh.engine.core.executor.worker.kv.mover.stats.store_read_failures == 3
    assert file_store.num_deleted_bad == 3
    fresh.engine.core.shutdown()
    # Deleted, then written again from the recomputed blocks: valid files now.
    assert all(len(file_store.read(h)) == file_store.layout.block_bytes for h in first_hashes)


def test_file_store_stays_within_its_budget(qwen3_checkpoint, tmp_path):
    store = tmp_path / "store"
    llm = LLM(str(qwen3_checkpoint), kv_store_dir=str(store), progress=False)
    file_store = llm.engine.core.executor.worker.kv.mover.store
    budget = 20 * (file_store.layout.block_bytes + 1024)  # room for ~20 block files
    file_store.capacity_bytes = budget
    llm.generate(_prompts(10, 70, seed=4), GREEDY)  # 40 blocks
    llm.engine.core.shutdown()
    files = list(store.rglob(f"*{SUFFIX}"))
    assert 0 < sum(p.stat().st_size for p in files) <= budget
    assert file_store.num_evicted > 0 and len(files) < 40
    # Names come from hashes only (hex), never from request content.
    assert all(p.name.removesuffix(SUFFIX).isalnum() for p in files)


BLOCK_BYTES = 16 * 2 * 2 * 2 * 16 * 4  # the test checkpoint's 16-token block: K and V, fp32


def test_a_pinned_prefix_outlives_evictions_the_file_budget_and_a_restart(
        qwen3_checkpoint, plain, tmp_path):
    store = tmp_path / "store"
    llm = LLM(str(qwen3_checkpoint), kv_store_dir=str(store), kv_cache_memory=12 * BLOCK_BYTES,
              kv_host_memory=12 * BLOCK_BYTES, max_model_len=96, progress=False)
    core, file_store = llm.engine.core, llm.engine.core.executor.worker.kv.mover.store
    prompt = _prompts(1, 70, seed=9)[0]
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt, 16)
    pin = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, cache_pins=[[64, 3600]])
    out = llm.generate([prompt], pin)[0]
    assert out.pinned_tokens == [64] and _tokens([out]) == _tokens(plain.generate([prompt], GREEDY))
    assert all(h in core.kv.pins for h in hashes[:4])
    file_store.capacity_bytes = 8 * (BLOCK_BYTES + 1024)  # room for ~8 block files
    llm.generate(_prompts(10, 70, seed=10), GREEDY)  # 40 blocks through every tier
    assert all(h in core.kv.host for h in hashes[:4])  # the host tier kept them (12 slots)
    llm.engine.core.shutdown()
    assert file_store.num_evicted > 0 and all(file_store.contains(h) for h in hashes[:4])
    # A restarted engine finds them in the store (its files are dated to the pin's end),
    # but for a corrupted one: refused, recomputed from there, the tokens unchanged.
    path = file_store.path_of(hashes[3])
    path.write_bytes(path.read_bytes()[:-7] + b"garbage")
    fresh = LLM(str(qwen3_checkpoint), kv_store_dir=str(store), progress=False)
    again = fresh.generate([prompt], GREEDY)[0]
    assert again.prompt_sources == PromptSources(0, 0, 48, 0, 22) and again.pinned_tokens is None
    assert _tokens([again]) == _tokens([out])


def test_pins_past_the_cap_are_refused_and_pins_end(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint), kv_pin_memory=3 * BLOCK_BYTES, progress=False)
    core = llm.engine.core
    wide, short = _prompts(2, 70, seed=11)
    pins = lambda *p: SamplingParams(temperature=0, max_tokens=2, cache_pins=[*p])  # noqa: E731
    assert llm.generate([wide], pins([64, 60]))[0].pinned_tokens == [0]  # 4 blocks > 3
    assert llm.generate([short], pins([32, 0.3]))[0].pinned_tokens == [32]
    assert len(core.kv.pins) == 2 and core.kv.pins.num_refused == 1
    time.sleep(0.4)
    llm.generate([wide], GREEDY)  # a step: the pin ended
    assert len(core.kv.pins) == 0
    # Two TTLs on one prefix: its first blocks are held until the longer one ends.
    assert llm.generate([short], pins([32, 0.3], [48, 60]))[0].pinned_tokens == [32, 48]
    time.sleep(0.4)
    llm.generate([wide], GREEDY)
    assert len(core.kv.pins) == 3


def test_a_queued_request_reads_its_prefix_from_files_while_it_waits(qwen3_checkpoint, plain,
                                                                      tmp_path):
    """One request at a time: the second waits behind the first, and its blocks come from the
    file store meanwhile (an agent coming back while the engine is busy)."""
    store = tmp_path / "store"
    prompt = _prompts(1, 70, seed=12)[0]
    writer = LLM(str(qwen3_checkpoint), kv_store_dir=str(store), progress=False)
    writer.generate([prompt], GREEDY)
    writer.engine.core.shutdown()
    llm = LLM(str(qwen3_checkpoint), kv_store_dir=str(store), max_num_seqs=1, progress=False)
    core = llm.engine.core
    busy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    core.add_request("busy", _prompts(1, 20, seed=13)[0], busy)
    core.add_request("back", prompt, GREEDY)
    done: dict[str, list[int]] = {}
    sources = {}
    loaded_while_queued = False
    while core.has_unfinished_requests():
        for out in core.step():
            done.setdefault(out.request_id, []).extend(out.new_token_ids)
            sources[out.request_id] = out.prompt_sources or sources.get(out.request_id)
        back = core.scheduler.requests.get("back")
        loaded_while_queued |= (back is not None and back.store_load_tried
                                and "busy" in core.scheduler.requests)
    assert loaded_while_queued and core.scheduler.num_waiting_for_kv == 0
    assert sources["back"] == PromptSources(0, 0, 64, 0, 6)
    assert done["back"] == _tokens(plain.generate([prompt], GREEDY))[0]
