"""A mixture-of-experts layer's routed experts in Triton: ``FusedExperts.forward_cuda``
(openinfer/layers/moe.py), the CUDA counterpart of the fused CPU kernel, with the same contract
(weights and slots [T, k]; a slot ``num_slots`` is another rank's pair and adds nothing).

Every shape in it follows from the number of tokens alone, and nothing reads a tensor's value
on the host, so a CUDA graph captured for a decode batch size replays it for any routing::

    slots [T, k] ─ align_pairs: the T*k pairs sorted by expert (stable: token order within an
                   expert), each expert's run padded to BLOCK_M rows, into a fixed-size list
                   (T*k + E*(BLOCK_M-1) rows, rounded up); each block of BLOCK_M rows has one
                   expert, or none (a padding block: its programs return at once)
    1: h[p] = x[token p] . W13[e]^T (+ b13[e])          grouped GEMM, a program per block x BLOCK_N
    2: a[p] = act(gate h[p], up h[p])                   torch (the layer's own activation)
    3: y[p] = weight[p] * (a[p] . W2[e]^T (+ b2[e]))    the same kernel, fp32 rows
    4: out[t] = sum_j y[t * k + j]                      top-k order: a row never depends on the batch

Products accumulate in fp32 (operands in the weights' dtype for the tensor cores, as vLLM's
fused_moe kernel does); h is rounded to the layer's dtype, y stays fp32 until the sum.
Under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors (tests/kernels/test_triton_moe.py),
with fp32 dots there (the interpreter multiplies bf16 as raw bits, openinfer.kernels.
triton_attention).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from openinfer.kernels.triton_attention import _dot, interpreted

BLOCK_N = 64
BLOCK_K = 32


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, bias_ptr, c_ptr, pair_ids_ptr, block_expert_ptr, pair_weight_ptr,
    num_pairs, N, K,
    stride_am, stride_we, stride_wn, stride_wk, stride_be, stride_cm,
    ROWS_PER_A: tl.constexpr, NUM_EXPERTS: tl.constexpr, HAS_BIAS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr, FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """c[pair] = a[pair // ROWS_PER_A] . w[e]^T (+ bias[e]) (* weight[pair]) for the BLOCK_M
    pairs of one block (all of expert e) and BLOCK_N output columns."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= NUM_EXPERTS:  # a padding block
        return
    pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    a_rows = (pairs // ROWS_PER_A).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += _dot(a, w, FP32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(pair_weight_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    tl.store(c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + cols[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def block_m_for(pairs: int, num_experts: int) -> int:
    """Rows per block: 16 (tl.dot's least) while the pairs are few per expert (decode), 64 once
    an average expert fills it (prefill)."""
    return 64 if pairs >= 64 * num_experts else 16


def align_pairs(slots: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair ids [P], block experts [P / block_m]) for ``slots`` [T, k]: pair t*k+j listed in
    its expert's run, runs padded to ``block_m`` with the id T*k (no pair), a block's expert
    ``num_experts`` where it is padding. P = T*k + num_experts*(block_m - 1), rounded up to
    ``block_m``: a bound on any routing's padded length, so the shapes depend on T alone."""
    flat = slots.flatten()
    n = flat.numel()
    rows = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    ones = torch.ones_like(flat)
    counts = torch.zeros(num_experts + 1, dtype=flat.dtype, device=flat.device)
    counts = counts.scatter_add_(0, flat, ones)[:num_experts]  # (bincount would sync to size it)
    padded = (counts + block_m - 1) // block_m * block_m
    run_end = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices
    expert = flat[order]
    here = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    rank = torch.arange(n, device=flat.device) - (counts.cumsum(0) - counts)[e]  # within its expert
    dest = torch.where(here, run_end[e] - padded[e] + rank, rows)
    pair_ids = torch.full((rows + 1,), n, dtype=torch.long, device=flat.device)
    pair_ids.scatter_(0, dest, order)
    starts = torch.arange(0, rows, block_m, device=flat.device)
    block_expert = torch.searchsorted(run_end, starts, right=True)
    return pair_ids[:rows], block_expert


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                  pair_ids: torch.Tensor, block_expert: torch.Tensor, rows_per_a: int, block_m: int,
                  pair_weight: torch.Tensor | None = None) -> None:
    num_experts, n, k = w.shape
    grid = (block_expert.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](
        a, w, bias if bias is not None else w, out, pair_ids, block_expert,
        pair_weight if pair_weight is not None else out,
        out.shape[0], n, k,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), bias.stride(0) if bias is not None else 0,
        out.stride(0),
        ROWS_PER_A=rows_per_a, NUM_EXPERTS=num_experts, HAS_BIAS=bias is not None,
        MUL_WEIGHT=pair_weight is not None, FP32=a.dtype == torch.float32 or interpreted(),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None,
                  b2: torch.Tensor | None, weights: torch.Tensor, slots: torch.Tensor,
                  activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{slots[t, j]}(x[t]) (x [T, H]; w13 [E, 2I, H]; w2 [E, H, I])."""
    tokens, top_k = slots.shape
    num_experts, two_i, hidden = w13.shape
    pairs = tokens * top_k
    block_m = block_m_for(pairs, num_experts)
    pair_ids, block_expert = align_pairs(slots, num_experts, block_m)
    x = x.contiguous()
    h = torch.empty(pairs, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, b13, h, pair_ids, block_expert, top_k, block_m)
    act = activation(*h.chunk(2, dim=-1)).contiguous()
    y = torch.zeros(pairs, hidden, dtype=torch.float32, device=x.device)  # pairs not here: 0
    _grouped_gemm(act, w2, b2, y, pair_ids, block_expert, 1, block_m,
                  weights.float().flatten().contiguous())
    return y.view(tokens, top_k, hidden).sum(1).to(x.dtype)
