"""The KV pages a request reads, logical block by logical block: what makes a check of a
prefix hit, a tier reload or a disaggregated pull order-sensitive.

Tokens cannot see a sequence's blocks permuted on a full-attention model: attention over
the earlier positions ignores the order of their keys (RoPE is already in the keys). The
pages can: logical block i of a request must hold the KV of its tokens 16i..16i+15, as a
plain engine that computed them has it."""

from __future__ import annotations

import itertools
import time

import torch

from openinfer import LLM, SamplingParams

_ids = itertools.count()


def prompt_pages(llm: LLM, prompt: list[int], params: SamplingParams | None = None,
                 timeout_s: float = 120.0) -> list[torch.Tensor]:
    """Run ``prompt`` alone through ``llm``'s engine core and return a copy of the page of
    each full block of the prompt, in the order of the request's block table, read once the
    prompt is in the cache (the first output token sampled, the request still running).
    Only the first layer group (the full-attention models these tests use have one)."""
    core = llm.engine.core
    params = params or SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    assert params.max_tokens is None or params.max_tokens >= 2, "the request must outlive its prompt"
    request_id = f"pages-{next(_ids)}"
    core.add_request(request_id, list(prompt), params)
    num_blocks = len(prompt) // core.kv.block_size
    pages = None
    deadline = time.monotonic() + timeout_s  # loads and pulls land between steps
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "the request did not finish"
        core.step()
        req = core.scheduler.requests.get(request_id)
        if pages is None and req is not None and req.num_computed_tokens >= len(prompt):
            table = core.kv.block_table(request_id)[0][:num_blocks]
            cache = core.executor.worker.kv_caches[0]
            pages = [cache[block].clone() for block in table]
    assert pages is not None and len(pages) == num_blocks, "the prompt was never in the cache"
    return pages


def assert_same_pages(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Block by block equal (up to the rounding of another batch), and each differs from
    the others: a permutation of the blocks cannot pass."""
    assert len(got) == len(want) > 1
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, i=i: f"block {i}: {m}")
    for i, j in itertools.combinations(range(len(want)), 2):
        assert not torch.allclose(want[i], want[j], rtol=1e-2, atol=1e-3), (i, j)
