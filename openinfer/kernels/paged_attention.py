"""Torch reference ops for attention over a paged KV cache.

One layer's cache is a tensor ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``
(index 0 = K, 1 = V); it is a view into a block-major pool where a block holds all
layers of its group contiguously (so offloading a block is one copy).

A token's cache slot is (block id, offset in block). A sequence's KV is found through
its block table: token ``i`` lives in block ``table[i // block_size]`` at offset
``i % block_size``.

These ops are the correctness reference that faster kernels are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_block: torch.Tensor,
    slot_offset: torch.Tensor,
) -> None:
    """Store the K/V of the step's tokens ([T, H, D]) into their slots."""
    cache[slot_block, 0, slot_offset] = k.to(cache.dtype)
    cache[slot_block, 1, slot_offset] = v.to(cache.dtype)


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first ``length`` tokens, as [length, H, D] each."""
    block_size, num_heads, head_dim = cache.shape[2:]
    num_blocks = -(-length // block_size)
    # Gather K and V separately: each lands contiguous, so merging (block, offset) is free.
    k = cache[:, 0][block_table[:num_blocks]].view(-1, num_heads, head_dim)[:length]
    v = cache[:, 1][block_table[:num_blocks]].view(-1, num_heads, head_dim)[:length]
    return k, v


def decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence attending to its whole cached context.

    q: [B, Hq, D]; block_tables: [B, max_blocks]; seq_lens: [B] (context incl. the
    query token, whose KV is already written). Returns [B, Hq, D].
    """
    batch = q.shape[0]
    block_size, num_kv_heads, head_dim = cache.shape[2:]
    num_blocks = -(-max_seq_len // block_size)
    tables = block_tables[:, :num_blocks]
    length = num_blocks * block_size
    # [B, nb, bs, H, D] -> [B, H, L, D] (a view: SDPA takes strided inputs)
    k = cache[:, 0][tables].view(batch, length, num_kv_heads, head_dim).transpose(1, 2)
    v = cache[:, 1][tables].view(batch, length, num_kv_heads, head_dim).transpose(1, 2)
    positions = torch.arange(length, device=q.device)
    mask = (positions[None, :] < seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2).to(k.dtype), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.squeeze(2).to(q.dtype)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:
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
