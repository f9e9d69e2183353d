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

import torch
import torch.nn.functional as F


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the K/V of the step's tokens ([T, H, D]) into their slots."""
    block_size = cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    cache[0].index_put_((blocks, offsets), k.to(cache.dtype))
    cache[1].index_put_((blocks, offsets), v.to(cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor,
              length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first ``length`` tokens, as [length, H, D] each."""
    _, _, block_size, num_heads, head_dim = cache.shape
    blocks = block_table[:-(-length // block_size)]
    k = cache[0].index_select(0, blocks).view(-1, num_heads, head_dim)[:length]
    v = cache[1].index_select(0, blocks).view(-1, num_heads, head_dim)[:length]
    return k, v


def decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                     mask: torch.Tensor, scale: float) -> torch.Tensor:
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
