"""Paged varlen attention in Triton: the KV write and one attention kernel for every sequence.

The contract is the CPU kernel's (``openinfer/kernels/cpu_attention.py``): a step packs decodes
first, then prefill chunks, into one flat batch of query rows; query ``i`` of sequence ``b``
(``q_len`` rows) sits at position ``seq_len - q_len + i`` and attends keys ``0 ..`` that
position; key ``t`` lives in block ``block_tables[b, t // page]`` at slot ``t % page``. K/V are
read in place through the block table, never gathered into a per-sequence copy.

Tiling. A program owns one *query tile* of one sequence and one KV head. Its rows are
``BLOCK_M = BLOCK_Q x GROUP_PAD`` (query tokens x the query heads that share the KV head,
padded to a power of two), so the K/V tile it loads serves every head of the group (GQA is
a wider M, not a second read of the cache)::

    row r  ->  token  q_tile_start + r // GROUP_PAD,   query head  kv_head * GROUP + r % GROUP_PAD

It walks the keys ``0 .. min(seq_len, last position of the tile) - 1`` in tiles of ``BLOCK_N``
keys. Each key finds its page through the block table (one int32 load per key per tile), so
any page size works and a tile may straddle pages. Per key tile: ``S = Q K^T`` (fp32
accumulate), the causal mask ``key <= position(row)``, then the online softmax (running row
max ``m`` and sum ``l`` in fp32, base 2: scores times ``log2(e)``) rescales the
fp32 accumulator and adds ``P V`` (``P`` cast to the cache dtype for the tensor cores, as
FlashAttention does). Head dims that are not a power of two (80, 96) are padded to ``BLOCK_D``
with masked loads.

Two launches per layer. Prefill chunks (continuations and prefix hits are just longer
``seq_len``) use ``BLOCK_M = 64`` rows; their tiles come from a host-side map (sequence,
first token), built once per step from the scheduler's Python ints, longest context first so
the longest programs start first. Decodes use ``BLOCK_M = max(16, GROUP_PAD)`` (16 is the
smallest ``tl.dot``) with one program per (sequence, KV head); where that is too few programs
to fill the GPU, the context is split over a third grid axis (split-KV): each split writes
its unnormalised accumulator and ``(m, l)`` in fp32 and a second kernel merges them. The
number of splits is a launch argument; each *sequence's* split length is computed in the
kernel from its own length (its visible keys over the splits, at least ``min_keys_per_split``,
in whole key tiles), so a short context in a batch of long ones takes few splits and the
launch depends on no step's lengths (a CUDA graph replays it for any lengths; a split past
a sequence's end reads nothing and weighs nothing in the merge).

Variants (per layer, the CPU kernel's): a sliding window (rows read keys ``position - window + 1
.. position``; a tile's loop starts at its first row's window), tanh soft-capping of the scores,
and per-head attention sinks (a logit in each row's softmax denominator, added where the row is
normalised: at the end of a program, or in the split merge).

Under ``TRITON_INTERPRET=1`` (set before triton is first imported) the same kernels run on CPU
tensors through Triton's interpreter: that is how the tests check them without a GPU. Two
interpreter bugs are worked around: its dot multiplies bf16 as raw bits (bf16 dots are done
in fp32 on CPU tensors) and it rounds fp32 -> bf16 toward zero (the tests allow one ulp).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from openinfer.kernels.kv_quant import inverse_scale, is_fp8

PREFILL_BLOCK_M = 64  # query rows (tokens x heads of a group) per prefill program
DECODE_BLOCK_N = 64  # keys per tile of a decode program: long, bandwidth-bound loops
MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost outweighs its parallelism


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_ckb, stride_cks, stride_ckh, stride_ckd,
    stride_cvb, stride_cvs, stride_cvh, stride_cvd,
    num_kv_heads, k_scale_inv, v_scale_inv,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MANTISSA: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr,
):
    """One program per token: its [Hkv, D] K and V rows into their slot (negative = skip).
    FP8_MAX > 0: a float8 cache, values scaled by 1 / their scale and clamped to +-FP8_MAX."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    block = slot // PAGE
    offset = slot % PAGE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd,
                mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd,
                mask=mask)
    if FP8_MAX > 0:
        k = tl.minimum(tl.maximum(k.to(tl.float32) * k_scale_inv, -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32) * v_scale_inv, -FP8_MAX), FP8_MAX)
        k = _round_to_float8(k, FP8_MANTISSA, FP8_MIN_NORMAL)
        v = _round_to_float8(v, FP8_MANTISSA, FP8_MIN_NORMAL)
    k_dst = k_cache_ptr + block * stride_ckb + offset * stride_cks
    v_dst = v_cache_ptr + block * stride_cvb + offset * stride_cvs
    tl.store(k_dst + heads[:, None] * stride_ckh + dims[None, :] * stride_ckd,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + heads[:, None] * stride_cvh + dims[None, :] * stride_cvd,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_to_float8(x, MANTISSA: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """fp32 values rounded to nearest even on the float8 grid (MANTISSA bits; below MIN_NORMAL the
    subnormals' fixed step), so that the conversion after is exact. The GPU's conversion rounds so
    itself; Triton's interpreter truncates the exponent's carry (31.9 becomes 16, not 32)."""
    shift: tl.constexpr = 23 - MANTISSA
    bits = x.to(tl.uint32, bitcast=True)
    normal = ((bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) >> shift) << shift
    # Below the smallest normal the step is MIN_NORMAL / 2^MANTISSA: adding 1.5 x 2^23 steps
    # rounds to a multiple of it (to nearest even), subtracting gives it back exactly; the sign
    # is put back after (-0.0 stays -0.0).
    magic: tl.constexpr = 1.5 * 8388608.0 * MIN_NORMAL / (1 << MANTISSA)
    subnormal = ((tl.abs(x) + magic) - magic).to(tl.uint32, bitcast=True) | ((bits >> 31) << 31)
    return tl.where(tl.abs(x) < MIN_NORMAL, subnormal, normal).to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, FP32: tl.constexpr):
    """a @ b with an fp32 accumulator. FP32: exact fp32 products ("ieee", not TF32) for fp32
    caches, and for bf16 in Triton's CPU interpreter, whose dot would multiply bf16 operands
    as their raw uint16 bits. Compiled fp16/bf16 kernels keep the operands for the tensor cores."""
    if FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _normaliser(m, total, sinks_ptr, head, HAS_SINKS: tl.constexpr):
    """What a row's accumulator (running max m and sum ``total``, base 2) is multiplied by:
    1 / total, or with a sink logit s, 2^(m - M) / (total 2^(m - M) + 2^(s - M)), M = max(m, s)."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(m, sink)
        a = tl.exp2(m - top)
        return a / (total * a + tl.exp2(sink - top))
    return 1.0 / tl.where(total > 0, total, 1.0)


@triton.jit
def _attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, tile_seq_ptr, tile_start_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr, sinks_ptr,
    scale, window, softcap, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    min_keys_per_split,
    num_q_heads,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    FP8_CACHE: tl.constexpr,
):
    """Grid (query tiles, KV heads, KV splits). See the module docstring for the tiling.
    FP8_CACHE: K/V tiles are widened to q's dtype as loaded (``scale`` carries K's per-tensor
    scale, ``v_scale`` multiplies each result row)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    q_tile_start = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # keys cached before this step's chunk

    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    token = q_tile_start + rows // GROUP_PAD  # the row's query, 0-based in the chunk
    head = kv_head * GROUP + rows % GROUP_PAD
    row_valid = (token < q_len) & (rows % GROUP_PAD < GROUP)
    position = context + token  # the row attends keys 0 .. position
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    row_dim_valid = row_valid[:, None] & dim_valid[None, :]

    q_rows = (q_begin + token).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=row_dim_valid, other=0.0)
    if not FP8_CACHE:
        q = q.to(k_cache_ptr.dtype.element_ty)

    # Keys this tile needs: up to its last row's position, from its first row's window start
    # (blocks before it may be released); with split-KV, this split's share of them.
    kv_stop = tl.minimum(seq_len, context + tl.minimum(q_tile_start + BLOCK_Q, q_len))
    kv_start = 0
    if WINDOWED:
        kv_start = tl.maximum(kv_start, context + q_tile_start - window + 1)
    if SPLIT:
        per_split = tl.maximum(tl.cdiv(kv_stop - kv_start, tl.num_programs(2)), min_keys_per_split)
        per_split = tl.cdiv(per_split, BLOCK_N) * BLOCK_N  # whole key tiles
        kv_start = kv_start + split * per_split
        kv_stop = tl.minimum(kv_stop, kv_start + per_split)

    # A finite floor for the running max: a row with no visible key yet keeps alpha = 1 and
    # p = exp2(-inf) = 0 instead of exp2(-inf - -inf) = NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_start, kv_stop, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_valid = keys < kv_stop
        page = tl.load(table + keys // PAGE, mask=key_valid, other=0).to(tl.int64)
        slot = keys % PAGE
        k_addr = page * stride_kb + slot * stride_ks + kv_head * stride_kh
        k_t = tl.load(k_cache_ptr + k_addr[None, :] + dims[:, None] * stride_kd,
                      mask=key_valid[None, :] & dim_valid[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]: K^T
        if FP8_CACHE:
            k_t = k_t.to(q.dtype)
        s = _dot(q, k_t, DOT_FP32) * scale
        if SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 1 - 2 / (e^2x + 1)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        s = s * 1.4426950408889634
        visible = (keys[None, :] <= position[:, None]) & key_valid[None, :]
        if WINDOWED:
            visible = visible & (keys[None, :] > position[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_addr = page * stride_vb + slot * stride_vs + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_addr[:, None] + dims[None, :] * stride_vd,
                    mask=key_valid[:, None] & dim_valid[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        if FP8_CACHE:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)
        m_i = m_new

    if SPLIT:
        # Partials of (decode tile, head, split); the merge kernel normalises.
        part = (tile.to(tl.int64) * num_q_heads + head) * tl.num_programs(2) + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_dim_valid)
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)
    else:
        out = acc * (_normaliser(m_i, l_i, sinks_ptr, head, HAS_SINKS) * v_scale)[:, None]
        o_rows = (q_begin + token).to(tl.int64) * stride_ot + head * stride_oh
        tl.store(out_ptr + o_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_dim_valid)


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, query_start_loc_ptr, sinks_ptr,
    stride_ot, stride_oh, num_splits, v_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Grid (decodes, query heads): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
    An empty split (m = -1e30, l = 0, acc = 0) weighs nothing."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_valid = splits < num_splits
    part = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits + splits
    m_s = tl.load(part_m_ptr + part, mask=split_valid, other=-1.0e30)
    l_s = tl.load(part_l_ptr + part, mask=split_valid, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                  mask=split_valid[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    top = tl.max(m_s, 0)
    weight = tl.exp2(m_s - top)
    out = tl.sum(acc * weight[:, None], 0) * (_normaliser(top, tl.sum(l_s * weight, 0), sinks_ptr,
                                                          head, HAS_SINKS) * v_scale)
    row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def interpreted() -> bool:
    """Whether these kernels run in Triton's CPU interpreter. ``triton.jit`` decides when a
    function is defined, so TRITON_INTERPRET=1 must have been set before this module *and*
    triton.language (whose tl.zeros, tl.max, ... are jit functions too) were imported."""
    from triton.runtime.interpreter import InterpretedFunction

    return all(isinstance(fn, InterpretedFunction) for fn in (_attention_kernel, tl.standard.zeros))


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store k/v [T, Hkv, D] into ``cache`` [2, num_blocks, page, Hkv, D] (any strides) at
    ``slot_mapping`` [T] (block * page + offset; negative slots are skipped), cast to the
    cache's dtype (a float8 cache: scaled and clamped, openinfer/kernels/kv_quant.py). The same
    contract as ``openinfer.kernels.paged_attention.write_kv``."""
    tokens, num_kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    key_cache, value_cache = cache[0], cache[1]
    _write_kv_kernel[(tokens,)](
        k, v, key_cache, value_cache, slot_mapping,
        *k.stride(), *v.stride(), *key_cache.stride(), *value_cache.stride(),
        num_kv_heads, inverse_scale(k_scale), inverse_scale(v_scale),
        PAGE=cache.shape[2], HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8_MAX=torch.finfo(cache.dtype).max if is_fp8(cache.dtype) else 0.0,
        FP8_MANTISSA=3 if cache.dtype == torch.float8_e4m3fn else 2,
        FP8_MIN_NORMAL=torch.finfo(cache.dtype).tiny if is_fp8(cache.dtype) else 1.0,
    )



@dataclass
class AttentionPlan:
    """How one step's attention is cut into programs; made once per step (it depends on the
    lengths and the layer geometry, not on a layer's data) and shared by every layer."""

    num_decodes: int
    decode_tiles: torch.Tensor
    """[2, num_decodes] int32: (sequence, first token) of each decode program: (b, 0)."""
    decode_splits: int
    min_keys_per_split: int
    """A decode's splits cover at least this many keys each (a shorter context uses fewer)."""
    prefill_tiles: torch.Tensor
    """[2, n] int32: (sequence, first token) of each prefill program, longest context first."""
    prefill_block_q: int


def group_pad(group: int) -> int:
    return triton.next_power_of_2(group)


def prefill_block_q(group: int) -> int:
    """Query tokens per prefill tile: the rows of a tile are tokens x padded group."""
    return max(1, PREFILL_BLOCK_M // group_pad(group))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_splits(num_decodes: int, num_kv_heads: int, max_decode_len: int, device: torch.device,
                  forced: int | None = None) -> int:
    """How many parts the longest decode context (``max_decode_len``; a CUDA graph passes
    ``max_model_len``) may be split into: enough programs for ~2 per SM, but at least
    MIN_KEYS_PER_SPLIT keys each. No split in the interpreter (it only costs time there)
    unless ``forced``."""
    if forced is not None:
        return max(1, min(forced, -(-max_decode_len // DECODE_BLOCK_N)))
    if device.type != "cuda" or num_decodes == 0:
        return 1
    programs = num_decodes * num_kv_heads
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    wanted = -(-2 * sms // programs)
    return max(1, min(wanted, max_decode_len // MIN_KEYS_PER_SPLIT, 64))


def plan_attention(query_lens: list[int], seq_lens: list[int], num_decodes: int, group: int,
                   num_kv_heads: int, device: torch.device | str,
                   num_kv_splits: int | None = None) -> AttentionPlan:
    """The step's programs from its Python ints (no device sync): one decode program per
    sequence (times splits), prefill chunks cut into tiles of ``prefill_block_q(group)`` tokens."""
    device = torch.device(device)
    block_q = prefill_block_q(group)
    q_lens = np.asarray(query_lens[num_decodes:], dtype=np.int64)
    s_lens = np.asarray(seq_lens[num_decodes:], dtype=np.int64)
    counts = -(-q_lens // block_q)
    seqs = np.repeat(np.arange(num_decodes, len(query_lens)), counts)
    firsts = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    firsts *= block_q
    # A tile's work grows with its keys: context + its last token. Longest first.
    ends = np.minimum(firsts + block_q, q_lens[seqs - num_decodes])
    keys = (s_lens - q_lens)[seqs - num_decodes] + ends
    order = np.argsort(-keys, kind="stable")
    prefill = np.stack([seqs[order], firsts[order]]).astype(np.int32)
    decode = np.stack([np.arange(num_decodes), np.zeros(num_decodes, dtype=np.int64)]).astype(np.int32)
    max_decode = max(seq_lens[:num_decodes], default=0)
    return AttentionPlan(
        num_decodes=num_decodes,
        decode_tiles=torch.from_numpy(decode).to(device),
        decode_splits=decode_splits(num_decodes, num_kv_heads, max_decode, device, num_kv_splits),
        # Forced splits (tests) cut even short contexts; planned ones keep a split's fixed
        # cost small beside its keys.
        min_keys_per_split=DECODE_BLOCK_N if num_kv_splits is not None else MIN_KEYS_PER_SPLIT,
        prefill_tiles=torch.from_numpy(prefill).to(device),
        prefill_block_q=block_q,
    )


def paged_attention(out: torch.Tensor, q: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    plan: AttentionPlan, window: int = 0, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> None:
    """out[T, Hq, D] = attention of q[T, Hq, D] over each sequence's paged K/V (the contract of
    ``openinfer.kernels.cpu_attention.paged_attention``; the step's own K/V already written).

    key_cache / value_cache: [num_blocks, page, Hkv, D], any strides. q and out: any token and
    head strides, unit stride over D. dtypes: the cache's fp32/fp16/bf16; q and out may differ
    (q is cast to the cache dtype, out written in its own). A float8 cache (e4m3fn, e5m2): its
    tiles are widened to q's dtype, entries read as stored value x ``k_scale`` / ``v_scale``.
    Accumulation in fp32. ``window``, ``softcap`` and ``sinks`` [Hq]: the CPU kernel's variants.
    """
    _, page, num_kv_heads, head_dim = key_cache.shape
    num_q_heads = q.shape[1]
    group = num_q_heads // num_kv_heads
    assert q.stride(-1) == 1 and out.stride(-1) == 1, "q and out need unit stride over head_dim"
    pad = group_pad(group)
    fp8 = is_fp8(key_cache.dtype)
    compute = q.dtype if fp8 else key_cache.dtype  # the dot products' operands
    common = dict(GROUP=group, GROUP_PAD=pad, HEAD_DIM=head_dim,
                  BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PAGE=page,
                  # CPU tensors mean the interpreter: compiled Triton never runs on them.
                  DOT_FP32=compute == torch.float32
                  or (compute == torch.bfloat16 and key_cache.device.type == "cpu"),
                  WINDOWED=window > 0, SOFTCAP=softcap > 0, HAS_SINKS=sinks is not None,
                  FP8_CACHE=fp8)
    sinks = sinks.float().contiguous() if sinks is not None else out
    args = [block_tables, query_start_loc, seq_lens]
    strides = [*q.stride()[:2], *out.stride()[:2], *key_cache.stride(), *value_cache.stride(),
               block_tables.stride(0)]
    if not fp8:  # (scales apply to float8 caches only)
        k_scale = v_scale = 1.0
    variant = (sinks, scale * k_scale, window, softcap, v_scale)
    nd = plan.num_decodes
    if plan.prefill_tiles.shape[1]:
        grid = (plan.prefill_tiles.shape[1], num_kv_heads, 1)
        _attention_kernel[grid](
            out, q, key_cache, value_cache, *args, plan.prefill_tiles[0], plan.prefill_tiles[1],
            out, out, out, *variant, *strides, 0, num_q_heads,
            BLOCK_M=plan.prefill_block_q * pad, BLOCK_N=64 if head_dim <= 64 else 32, SPLIT=False,
            num_warps=4, num_stages=2, **common)
    if nd:
        _decode(out, q, key_cache, value_cache, args, strides, variant, plan, num_q_heads, common)


def _decode(out: torch.Tensor, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            args: list[torch.Tensor], strides: list[int], variant: tuple, plan: AttentionPlan,
            num_q_heads: int, common: dict) -> None:
    """The decode launch: one query token per program, split-KV (plus the merge) if planned."""
    nd, splits = plan.num_decodes, plan.decode_splits
    block_m = max(16, common["GROUP_PAD"])
    grid = (nd, key_cache.shape[2], splits)
    tiles = (plan.decode_tiles[0], plan.decode_tiles[1])
    launch = dict(BLOCK_M=block_m, BLOCK_N=DECODE_BLOCK_N, num_warps=4, num_stages=2, **common)
    if splits == 1:
        _attention_kernel[grid](out, q, key_cache, value_cache, *args, *tiles, out, out, out,
                                *variant, *strides, 0, num_q_heads, SPLIT=False, **launch)
        return
    head_dim = common["HEAD_DIM"]
    part_acc = torch.empty(nd, num_q_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    part_m = torch.empty(nd, num_q_heads, splits, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    _attention_kernel[grid](out, q, key_cache, value_cache, *args, *tiles, part_acc, part_m, part_l,
                            *variant, *strides, plan.min_keys_per_split, num_q_heads, SPLIT=True,
                            **launch)
    _merge_splits_kernel[(nd, num_q_heads)](
        out, part_acc, part_m, part_l, args[1], variant[0], *out.stride()[:2], splits, variant[4],
        HEAD_DIM=head_dim, BLOCK_D=common["BLOCK_D"], BLOCK_S=triton.next_power_of_2(splits),
        HAS_SINKS=common["HAS_SINKS"], num_warps=4)
