"""The caching CPU allocator (openinfer/cpu_allocator.py, kernels/cpu/caching_allocator.cpp).

Its own behaviour is checked in a fresh process each (it replaces the process's CPU allocator);
the engine test checks that a model's tokens do not depend on it, in this process.
"""

import subprocess
import sys
import textwrap

import pytest

from openinfer import LLM, SamplingParams, cpu_allocator

MiB = 1 << 20

PRELUDE = """
import threading, torch
from openinfer import cpu_allocator
from openinfer.kernels.cpu_attention import load_cpu_attention
MiB = 1 << 20
k = load_cpu_attention()
def stats():
    return cpu_allocator.stats(k)
def block(mib):
    return torch.empty(int(mib * MiB) // 4)
"""


def run_in_fresh_process(body: str) -> None:
    script = PRELUDE + textwrap.dedent(body)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_freed_large_blocks_serve_requests_of_about_their_size(kernels):
    run_in_fresh_process("""
        before = block(8)  # allocated before the install: freed by its own allocator later
        assert stats() is None
        assert cpu_allocator.install(k, limit=64 * MiB)
        a = block(8)
        address = a.data_ptr()
        del a
        assert stats().cached_bytes == 8 * MiB
        b = block(7)  # rounded up to whole 2 MiB: 8 MiB, the freed block
        assert b.data_ptr() == address and stats().hits == 1
        b.fill_(3.0)
        assert float(b.sum()) == 3.0 * b.numel()  # (no temporary of 1 MiB or more)
        del b
        c = block(2)  # a quarter of the free block: a block of its own
        assert c.data_ptr() != address and stats().cached_bytes == 8 * MiB
        small = block(0.5)  # under 1 MiB: the wrapped allocator's, not counted
        live = stats().live_blocks
        del small
        assert stats().live_blocks == live
        del before, c
        assert stats().live_blocks == 0
        assert stats().cached_bytes == 10 * MiB
    """)


def test_the_limit_keeps_the_last_freed_blocks(kernels):
    run_in_fresh_process("""
        assert cpu_allocator.install(k, limit=16 * MiB)
        blocks = [block(8) for _ in range(4)]
        addresses = [b.data_ptr() for b in blocks]
        while blocks:  # freed in order: the first two are released
            blocks.pop(0)
        assert stats().cached_bytes == 16 * MiB
        again = [block(8), block(8), block(8)]
        assert {b.data_ptr() for b in again[:2]} == set(addresses[2:])
        assert stats().hits == 2 and stats().misses == 5
        big = block(20)  # over the limit on its own: never kept
        del big, again
        assert stats().cached_bytes == 16 * MiB
        assert cpu_allocator.install(k, limit=0)  # off: everything kept is released
        assert stats().cached_bytes == 0
        x = block(8)
        del x
        assert stats().cached_bytes == 0
    """)


def test_out_of_memory_releases_the_kept_blocks_and_tries_again(kernels):
    run_in_fresh_process("""
        import resource
        torch.ones(1 << 20).sum()  # the thread pool's stacks exist before the limit
        assert cpu_allocator.install(k, limit=4096 * MiB)
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (size + 600 * MiB, resource.RLIM_INFINITY))
        kept = block(400)
        del kept
        assert stats().cached_bytes == 400 * MiB
        fresh = block(500)  # no room beside the kept 400 MiB: they go back, then it fits
        fresh.fill_(1.0)
        assert stats().cached_bytes == 0 and stats().live_blocks == 1
    """)


def test_threads_allocating_and_freeing_at_once_keep_their_bytes(kernels):
    run_in_fresh_process("""
        import random
        assert cpu_allocator.install(k, limit=48 * MiB)
        errors = []
        def churn(seed):
            rng = random.Random(seed)
            held = []
            for i in range(300):
                t = block(rng.choice([1, 1.5, 3, 7, 12]))
                t.fill_(seed * 1000 + i)
                held.append((t, seed * 1000 + i))
                if len(held) > 3:
                    t, value = held.pop(rng.randrange(len(held)))
                    if not bool((t == value).all()):
                        errors.append(value)
        threads = [threading.Thread(target=churn, args=(s,)) for s in (1, 2, 3)]
        for t in threads: t.start()
        for t in threads: t.join()
        assert not errors, errors
        s = stats()
        assert s.live_blocks == 0 and s.cached_bytes <= 48 * MiB and s.hits > 0
    """)


def test_a_malformed_limit_fails_the_config_naming_the_variable(monkeypatch, qwen3_checkpoint):
    monkeypatch.setenv(cpu_allocator.CPU_ALLOCATOR_CACHE_ENV, "plenty")
    with pytest.raises(ValueError, match=cpu_allocator.CPU_ALLOCATOR_CACHE_ENV):
        LLM(str(qwen3_checkpoint), progress=False)
    monkeypatch.setenv(cpu_allocator.CPU_ALLOCATOR_CACHE_ENV, "512MiB")
    assert cpu_allocator.cache_limit() == 512 * MiB


def test_tokens_do_not_depend_on_reused_blocks(kernels, make_checkpoint):
    """A model whose step activations are blocks of 1 MiB or more: greedy tokens with the
    allocator keeping nothing, then reusing blocks, are the same (no kernel reads memory it did
    not write); the worker installed it."""
    path = make_checkpoint(hidden_size=256, intermediate_size=1024, num_heads=4, num_kv_heads=2,
                           head_dim=64, max_position_embeddings=2048)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=2048, enable_prefix_caching=False,
              progress=False)
    assert cpu_allocator.stats(kernels) is not None
    prompts = [[(7 * i + 13 * j) % 900 + 10 for j in range(400 + 37 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def tokens() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    limit = cpu_allocator.cache_limit()
    try:
        assert cpu_allocator.install(kernels, limit=0)
        plain = tokens()
        assert cpu_allocator.install(kernels, limit=limit)
        hits = cpu_allocator.stats(kernels).hits
        tokens()  # fills the cache with this workload's blocks
        assert tokens() == plain
        assert cpu_allocator.stats(kernels).hits > hits
    finally:
        cpu_allocator.install(kernels, limit=limit)
