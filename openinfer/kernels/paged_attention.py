"""Torch reference ops for attention over a paged KV cache.

One layer's cache is a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 = K, 1 = V); it may be a strided view (the engine keeps every layer of a
block together), but each block's ``[block_size, H, D]`` is contiguous.
A token's cache slot is ``block_id * block_size + offset``; a sequence's KV is found
through its block table: token ``i`` lives in block ``table[i // block_size]`` at
offset ``i % block_size``.

These ops are the correctness reference that faster kernels are tested against.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from openinfer.kernels.kv_quant import dequantize_kv, is_fp8, quantize_kv


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store the K/V of the step's tokens ([T, H, D]) into their slots (into a float8 cache
    as ``kv_quant.quantize_kv`` with the per-tensor scales).

    A token's K (or V) is one contiguous row of H * D values in its block, and the blocks
    of a layer lie a page apart: seen as rows of H * D values from the layer's first block,
    token slot s is row ``s // block_size * rows_per_page + s % block_size``, so the write
    is one ``index_copy_`` of whole rows. (``index_put_`` with (block, offset) indices on the
    strided view did the same 5-10x slower: 4.7 ms against 0.44 ms per layer for a batch-32
    decode step of a 0.27B model on a 2-core Zen 3.)"""
    _, num_blocks, block_size, heads, head_dim = cache.shape
    row = heads * head_dim
    page = cache.stride(1)
    # torch's index ops have no float8 kernels: a float8 cache's bytes are written as uint8.
    raw = (lambda t: t.view(torch.uint8)) if is_fp8(cache.dtype) else (lambda t: t)
    if cache.stride()[2:] != (row, head_dim, 1) or page % row:
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        raw(cache[0]).index_put_((blocks, offsets), raw(quantize_kv(k, k_scale, cache.dtype)))
        raw(cache[1]).index_put_((blocks, offsets), raw(quantize_kv(v, v_scale, cache.dtype)))
        return
    rows_per_page = page // row
    index = slot_mapping // block_size * rows_per_page + slot_mapping % block_size
    shape = ((num_blocks - 1) * rows_per_page + block_size, row)
    for half, x, scale in zip(cache, (k, v), (k_scale, v_scale)):
        raw(half).as_strided(shape, (row, 1)).index_copy_(
            0, index, raw(quantize_kv(x.reshape(-1, row), scale, cache.dtype)))


def gather_kv_padded(cache: torch.Tensor, block_tables: torch.Tensor, k_scale: float = 1.0,
                     v_scale: float = 1.0, dtype: torch.dtype | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of several sequences at once, [R, blocks * block_size, H, D] each, from their
    block tables [R, blocks] (int64; padding entries read whatever block they name: the
    caller masks positions past each sequence's length). ``dtype``: a float8 cache's
    dequantized to it."""
    _, _, block_size, num_heads, head_dim = cache.shape
    rows = block_tables.shape[0]
    k = cache[0][block_tables].view(rows, -1, num_heads, head_dim)
    v = cache[1][block_tables].view(rows, -1, num_heads, head_dim)
    if is_fp8(cache.dtype):
        dtype = dtype or torch.float32
        return dequantize_kv(k, k_scale, dtype), dequantize_kv(v, v_scale, dtype)
    return k, v


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int, k_scale: float = 1.0,
              v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first ``length`` tokens, as [length, H, D] each (a float8
    cache's dequantized to float32)."""
    _, _, block_size, num_heads, head_dim = cache.shape
    blocks = block_table[:-(-length // block_size)]
    k = cache[0].index_select(0, blocks).view(-1, num_heads, head_dim)[:length]
    v = cache[1].index_select(0, blocks).view(-1, num_heads, head_dim)[:length]
    if is_fp8(cache.dtype):
        return dequantize_kv(k, k_scale, torch.float32), dequantize_kv(v, v_scale, torch.float32)
    return k, v


def decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                     mask: torch.Tensor, scale: float, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """One query token per sequence attending to its whole cached context.

    q: [B, Hq, D]; block_tables: [B, nb] (padded); mask: [B, 1, 1, nb * block_size],
    True where a key position is inside the sequence (its KV, including the query
    token's own, is already written). Returns [B, Hq, D].
    """
    batch, num_blocks = block_tables.shape
    _, _, block_size, num_heads, head_dim = cache.shape
    flat = block_tables.flatten()
    length = num_blocks * block_size
    # [B * nb, bs, H, D] -> [B, H, L, D] (a view: SDPA takes strided inputs)
    k = cache[0].index_select(0, flat).view(batch, length, num_heads, head_dim).transpose(1, 2)
    v = cache[1].index_select(0, flat).view(batch, length, num_heads, head_dim).transpose(1, 2)
    if is_fp8(cache.dtype):
        k, v = dequantize_kv(k, k_scale, torch.float32), dequantize_kv(v, v_scale, torch.float32)
    out = F.scaled_dot_product_attention(q.unsqueeze(2).to(k.dtype), k, v, attn_mask=mask,
                                         scale=scale, enable_gqa=True)
    return out.squeeze(2).to(q.dtype)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Causal attention of a chunk of ``n`` queries over ``L >= n`` keys.

    The queries are the last ``n`` positions of the sequence (a chunked-prefill
    continuation has ``L - n`` earlier tokens in the cache): query ``i`` sees keys
    ``0 .. L - n + i``. q: [n, Hq, D]; k, v: [L, H, D]. Returns [n, Hq, D].
    """
    n, length = q.shape[0], k.shape[0]
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k.to(q.dtype), v.to(q.dtype)))
    if n == length:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                             enable_gqa=True)
    else:
        rows = torch.arange(n, device=q.device)[:, None] + (length - n)
        mask = torch.arange(length, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


INVARIANT_GRAIN = 1 << 15
"""torch splits an elementwise op of this many elements or more across threads; where a thread's
range starts mid-vector, the elements before the next vector boundary take the scalar code, whose
exp (and silu) can round differently. Batch-invariant ops keep their transcendental steps under it."""
INVARIANT_KEY_CHUNK = 64
"""Keys per online-softmax step of ``batch_invariant_attention`` (rounded up to whole blocks):
a multiple of every vector loop's width, so no score ever takes a scalar tail."""


def batch_invariant_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                              query_lens: list[int], seq_lens: list[int],
                              scale: float, k_scale: float = 1.0,
                              v_scale: float = 1.0) -> torch.Tensor:
    """Attention of every query row of a step over its sequence's cached keys (all written
    already), each row's result bitwise independent of the other rows: of the other sequences,
    of where its own sequence's prompt was cut into chunks, of padding.

    q: [T, Hq, D] (sequences' rows consecutive, ``query_lens`` of them each); query ``i`` of
    sequence ``b`` sits at position ``seq_lens[b] - query_lens[b] + i``. block_tables: [B, nb].
    Returns [T, Hq, D] in q's dtype.

    Every row runs the same ops on tensors of the same shapes: keys in chunks of
    ``INVARIANT_KEY_CHUNK`` aligned to position 0 (each row reads its own sequence's blocks),
    scores as an elementwise product summed over D (no GEMM, whose kernel would depend on the
    row count), an online softmax in fp32 (keys after a row's position get -inf: exact zeros),
    P.V the same way. Rows go in tiles small enough that the exp stays on one thread. A chunk
    past a row's position changes nothing (alpha is exactly 1, p exactly 0). Slow: for
    ``--batch-invariant`` with the torch backend.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = cache.shape
    group = num_heads // num_kv_heads
    chunk = math.lcm(block_size, INVARIANT_KEY_CHUNK)  # whole blocks, whole vectors
    chunk_blocks = chunk // block_size
    device = q.device
    q_lens = torch.tensor(query_lens, dtype=torch.long)
    s_lens = torch.tensor(seq_lens, dtype=torch.long)
    seq_of_row = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)
    starts = torch.cumsum(q_lens, 0) - q_lens
    positions = ((s_lens - q_lens)[seq_of_row] + torch.arange(num_tokens) - starts[seq_of_row])
    num_chunks = -(-max(seq_lens, default=0) // chunk)
    # Entries past a sequence's blocks (padding, junk) read block 0 instead; what they hold is
    # masked out below.
    tables = torch.zeros(len(query_lens), num_chunks * chunk_blocks, dtype=torch.long)
    width = min(block_tables.shape[1], tables.shape[1])
    tables[:, :width] = block_tables[:, :width].long().cpu()
    owned = torch.arange(tables.shape[1])[None, :] < -(-s_lens // block_size)[:, None]
    tables = tables.masked_fill_(~owned, 0).to(device)
    positions_dev = positions.to(device)
    seq_of_row = seq_of_row.to(device)
    key_offsets = torch.arange(chunk, device=device)
    out = torch.empty_like(q)
    tile = max(1, (INVARIANT_GRAIN - 1) // (num_heads * chunk))
    for r0 in range(0, num_tokens, tile):
        r1 = min(num_tokens, r0 + tile)
        rows = r1 - r0
        qf = (q[r0:r1].float() * scale).view(rows, num_kv_heads, group, 1, head_dim)
        pos = positions_dev[r0:r1]
        row_tables = tables[seq_of_row[r0:r1]]
        m = torch.full((rows, num_kv_heads, group), float("-inf"), device=device)
        total = torch.zeros(rows, num_kv_heads, group, device=device)
        o = torch.zeros(rows, num_kv_heads, group, head_dim, device=device)
        for c in range(-(-(int(positions[r0:r1].max()) + 1) // chunk)):
            blocks = row_tables[:, c * chunk_blocks:(c + 1) * chunk_blocks].flatten()
            hidden = (c * chunk + key_offsets)[None, :] > pos[:, None]  # [rows, chunk]
            k = cache[0].index_select(0, blocks).view(rows, chunk, num_kv_heads, head_dim)
            v = cache[1].index_select(0, blocks).view(rows, chunk, num_kv_heads, head_dim)
            k, v = dequantize_kv(k, k_scale, torch.float32), dequantize_kv(v, v_scale, torch.float32)
            v = v.masked_fill(hidden[:, :, None, None], 0.0)  # 0 * junk could be NaN
            k = k.permute(0, 2, 1, 3).unsqueeze(2)  # [rows, Hkv, 1, chunk, D]
            v = v.permute(0, 2, 1, 3).unsqueeze(2)
            s = (qf * k).sum(-1)  # [rows, Hkv, G, chunk]
            s.masked_fill_(hidden[:, None, None, :], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))  # finite: key 0 is visible to every row
            p = torch.exp(s - m_new[..., None])
            alpha = torch.exp(m - m_new)
            total = total * alpha + p.sum(-1)
            o = o * alpha[..., None] + (p[..., None] * v).sum(-2)
            m = m_new
        out[r0:r1] = (o / total[..., None]).view(rows, num_heads, head_dim).to(q.dtype)
    return out
