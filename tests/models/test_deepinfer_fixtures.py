"""V4.1's blocks against numbers DeepInfer's own torch reference functions computed
(tests/fixtures/deepinfer_v41.npz, written by tests/fixtures/make_deepinfer_fixtures.py from
its source tarball): C2 pooling, the candidate blocks' maximum, and top-k within candidate
blocks (DeepInfer compacts the blocks' tokens and maps the choice back; openinfer masks)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from openinfer.models.arch import CandidateArch
from openinfer.models.v41_sparse import (
    V41Compressor,
    candidate_block_scores,
    candidate_entries,
    top_k_entries,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "deepinfer_v41.npz"


@pytest.fixture(scope="module")
def deepinfer():
    with np.load(FIXTURES) as data:
        return {name: torch.from_numpy(data[name]) for name in data.files}


def test_c2_pooling_is_deepinfers(deepinfer):
    pooled = V41Compressor.pool_pairs(deepinfer["c2_latent"], deepinfer["c2_score"])
    # DeepInfer rounds the float32 result to bf16: the same float32 sum, rounded alike.
    assert torch.equal(pooled.to(torch.bfloat16).float(), deepinfer["c2_pooled"])


def test_candidate_block_maximum_is_deepinfers(deepinfer):
    logits, valid = deepinfer["block_logits"], deepinfer["block_valid"].long()
    visible = torch.arange(logits.shape[1])[None, :] < valid[:, None]
    best, counts = candidate_block_scores(logits, visible, int(deepinfer["block_size"]))
    assert torch.equal(counts, deepinfer["block_counts"].long())
    in_range = torch.arange(best.shape[1])[None, :] < counts[:, None]
    assert torch.equal(best[in_range], deepinfer["block_scores"][in_range])
    assert best[0, 0] == torch.finfo(torch.bfloat16).max  # an infinite logit, capped


def test_top_k_within_candidate_blocks_is_deepinfers(deepinfer):
    logits, valid = deepinfer["cand_logits"], deepinfer["cand_valid"].long()
    visible = torch.arange(logits.shape[1])[None, :] < valid[:, None]
    candidate = CandidateArch(source=0, topk_blocks=int(deepinfer["cand_topk_blocks"]),
                              block_size=int(deepinfer["cand_block_size"]))
    chosen = top_k_entries(logits, visible & candidate_entries(logits, visible, candidate),
                           int(deepinfer["cand_k"]))
    for row, want in zip(chosen, deepinfer["cand_indices"], strict=True):
        assert row.nonzero().flatten().tolist() == sorted(i for i in want.tolist() if i >= 0)
    assert not torch.equal(chosen, top_k_entries(logits, visible, int(deepinfer["cand_k"])))  # they matter
