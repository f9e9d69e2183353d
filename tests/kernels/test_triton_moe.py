"""FusedExperts' CUDA path (openinfer/kernels/triton_moe.py: Triton grouped GEMMs over pairs
aligned by expert) against its torch path, in Triton's interpreter on a CPU (compiled on a GPU):
decode and prefill token counts, a slot repeated in a token's top-k, experts nobody chose,
another rank's slots, biases and activations, float32 and bfloat16; and the alignment's shapes
depend on the number of tokens alone (what lets a CUDA graph replay it)."""

from __future__ import annotations

import copy

import pytest
import torch
from attention_support import triton_test_device

DEVICE = triton_test_device()

from openinfer.kernels import triton_moe  # noqa: E402
from openinfer.kernels.custom_op import Platform  # noqa: E402
from openinfer.layers.moe import ClampedSwiGLU, FusedExperts, silu_and_mul  # noqa: E402


def _experts(num: int, hidden: int, inter: int, dtype: torch.dtype, bias: bool = False,
             activation=silu_and_mul) -> tuple[FusedExperts, FusedExperts]:
    """(the torch path, the Triton path) over the same random experts."""
    oracle = FusedExperts(num, hidden, inter, bias=bias, activation=activation)
    with torch.no_grad():
        for p in oracle.parameters():
            p.normal_(std=hidden ** -0.5)
    oracle = oracle.to(DEVICE, dtype)
    triton_path = copy.deepcopy(oracle)
    triton_path.bind(Platform("cuda", None))  # the CUDA path, whatever device runs it
    assert triton_path.forward_path == "forward_cuda"
    return oracle, triton_path


def _routing(tokens: int, num: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k choices that never pick expert 1, and give token 0 one slot twice."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num, generator=gen)[:top_k] for _ in range(tokens)])
    ids[ids == 1] = 0
    ids[0, -1] = ids[0, 0]
    return torch.rand(tokens, top_k, generator=gen).to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_matches_the_torch_path(dtype, tokens):
    """70 tokens x top-2 over 2 experts: 64-row blocks (prefill's); fewer: 16-row blocks."""
    torch.manual_seed(tokens)
    num = 2 if tokens == 70 else 6
    oracle, fused = _experts(num, 40, 24, dtype, bias=True,
                             activation=ClampedSwiGLU(1.702, 0.9) if tokens == 5 else silu_and_mul)
    weights, ids = _routing(tokens, num, 2, seed=tokens)
    x = torch.randn(tokens, 40).to(DEVICE, dtype)
    got = fused(x, weights, ids)
    want = copy.deepcopy(oracle).float()(x.float(), weights, ids)
    assert got.dtype == dtype and got.shape == x.shape
    # bf16: against float32 on the same weights, within a few bf16 steps of the output's scale
    # (h rounded once; the interpreter rounds toward zero, a compiled kernel to nearest).
    tol = 2e-5 if dtype == torch.float32 else 2 ** -6 * float(want.abs().max())
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=1e-5 if dtype == torch.float32 else 0)


def test_slots_of_another_rank_add_nothing():
    """Expert parallel hands the path ``num_slots`` for pairs another rank computes."""
    torch.manual_seed(2)
    oracle, fused = _experts(4, 32, 16, torch.float32)
    x, weights = torch.randn(6, 32).to(DEVICE), torch.rand(6, 2).to(DEVICE)
    slots = torch.tensor([[0, 4], [4, 4], [1, 2], [3, 4], [2, 1], [4, 0]]).to(DEVICE)
    got = fused.forward_cuda(x, weights, slots)
    torch.testing.assert_close(got, oracle.forward_native(x, weights, slots), atol=2e-5, rtol=1e-5)
    assert torch.equal(got[1], torch.zeros(32, device=DEVICE))


def test_alignment_shapes_depend_on_the_token_count_alone():
    """Any routing of T tokens gives the same shapes (T*k + E*(BLOCK_M-1), rounded up to a
    block), every pair once in its expert's blocks, and padding blocks marked."""
    num, block_m = 5, 16
    shapes = set()
    for seed, tokens in ((0, 9), (1, 9), (2, 9)):
        _, ids = _routing(tokens, num, 3, seed)
        if seed == 2:
            ids[:] = 3  # every pair on one expert
        pair_ids, block_expert = triton_moe.align_pairs(ids, num, block_m)
        shapes.add((pair_ids.shape, block_expert.shape))
        flat = ids.flatten().cpu()
        listed = pair_ids.cpu()[pair_ids.cpu() < flat.numel()]
        assert sorted(listed.tolist()) == list(range(flat.numel()))
        for block, expert in enumerate(block_expert.cpu().tolist()):
            rows = pair_ids.cpu()[block * block_m:(block + 1) * block_m]
            rows = rows[rows < flat.numel()]
            if expert == num:
                assert rows.numel() == 0
            else:
                assert (flat[rows] == expert).all() and rows.tolist() == sorted(rows.tolist())
    assert shapes == {(torch.Size([112]), torch.Size([7]))}  # 27 + 5 * 15 = 102, in blocks of 16
