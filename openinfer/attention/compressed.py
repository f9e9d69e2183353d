"""DeepSeek-V4's attention over its paged state (openinfer/models/deepseek_v4.py): each query
attends over a sliding window of keys (one shared head, K = V) plus the compressed *entries*
its position can see, with a per-head sink logit in the softmax. This module holds the page
arithmetic (which page and slot holds a token's row or an entry) and the sink softmax; the
model keeps the projections, the compressors that pool entries and the indexer that picks
them.

Pages: window keys and a compressor's raw rows are sliding-window pages of one row per token
(``[num_blocks, block_size, 1, dim]``, K half and V half); entries are ``CompressedSpec``
pages, ``block_size // ratio`` entries each, entry w in the page of its group's last token:

    tokens   0 1 2 3 | 4 5 6 7 | ...      (ratio 4, block_size 8: two entries a page)
    entry    w = 0     w = 1
    page     table[((w + 1) * ratio - 1) // block_size], slot w % (block_size // ratio)

The reference path: torch over one sequence at a time for prefills, the step's decodes
batched (padded to the longest window and entry count, masked). No fused kernel yet.
"""

from __future__ import annotations

import torch

from openinfer.attention.base import AttentionMetadata
from openinfer.kv.spec import CompressedSpec


def paged_rows(cache: torch.Tensor, table: list[int], positions: range,
               block_size: int) -> torch.Tensor:
    """Rows of one sequence's tokens at ``positions`` from a paged ``[num_blocks, bs, 1, dim]``
    cache half, as ``[len(positions), dim]``."""
    pos = torch.tensor(list(positions), dtype=torch.long)
    blocks = torch.tensor(table, dtype=torch.long)[pos // block_size]
    return cache[blocks, pos % block_size, 0]


def entry_index(ratio: int, block_size: int, tables: torch.Tensor,
                count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, slot) of entries 0 .. count - 1 for each row of ``tables`` [B, blocks]."""
    w = torch.arange(count, device=tables.device)
    block = ((w + 1) * ratio - 1) // block_size
    slot = w % max(1, block_size // ratio)
    block = block.clamp(max=tables.shape[1] - 1)  # entries past a row's own are masked
    return tables[:, block].long(), slot.expand(tables.shape[0], -1)


def store_entries(entry_cache: torch.Tensor, table: list[int], first: int,
                  entries: torch.Tensor, ratio: int, block_size: int) -> None:
    """Entries ``first ..`` (rows of ``entries``) of one sequence into their pages."""
    spec = CompressedSpec(block_size, ratio, entries.shape[-1], "float32")
    for i, row in enumerate(entries):
        block, slot = spec.entry_slot(first + i)
        entry_cache[table[block], slot] = row


def sequence_entries(entry_cache: torch.Tensor, meta: AttentionMetadata, b: int, ratio: int,
                     end: int) -> torch.Tensor:
    """All of sequence b's entries so far (its groups complete before ``end``): [count, dim]."""
    pages, slots = entry_index(ratio, meta.block_size, meta.block_tables[b:b + 1], end // ratio)
    return entry_cache[pages[0], slots[0]]


def sequence_window(window_cache: torch.Tensor, meta: AttentionMetadata, b: int, ctx: int,
                    end: int, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequence b's window keys for its queries at positions ctx .. end - 1: (keys [L, D],
    allowed [n, L], query positions [n])."""
    t = torch.arange(ctx, end, device=window_cache.device)
    first_key = max(0, ctx - window + 1)
    keys = paged_rows(window_cache[0], meta.block_tables[b].tolist(), range(first_key, end),
                      meta.block_size)
    kpos = torch.arange(first_key, end, device=window_cache.device)
    allowed = (kpos[None, :] <= t[:, None]) & (kpos[None, :] > t[:, None] - window)
    return keys, allowed, t


def decode_window(window_cache: torch.Tensor, meta: AttentionMetadata, num_decodes: int,
                  window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's decodes' window keys, padded to ``window``: (keys [B, W, D], allowed [B, W],
    query positions [B])."""
    bs = meta.block_size
    pos = meta.seq_lens[:num_decodes].long() - 1
    key_pos = pos[:, None] - window + 1 + torch.arange(window, device=window_cache.device)
    allowed = key_pos >= 0
    key_pos = key_pos.clamp(min=0)
    pages = meta.block_tables[:num_decodes].long().gather(1, key_pos // bs)
    return window_cache[0][pages, key_pos % bs, 0], allowed, pos


def decode_entries(entry_cache: torch.Tensor, meta: AttentionMetadata, num_decodes: int,
                   ratio: int, count: int) -> torch.Tensor:
    """The step's decodes' first ``count`` entries each: [B, count, D] (masked by the caller)."""
    pages, slots = entry_index(ratio, meta.block_size, meta.block_tables[:num_decodes], count)
    return entry_cache[pages, slots]


def attend_with_sinks(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor,
                      sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax over the allowed keys and one sink logit per head, times the keys (K = V).
    One sequence: q [n, H, D], keys [L, D], allowed [n, L]; a batch of decodes: q [B, H, D],
    keys [B, L, D], allowed [B, L]. Returns q's shape."""
    batched = keys.dim() == 3
    logits = torch.einsum("nhd,nld->nhl" if batched else "nhd,ld->nhl", q, keys) * scale
    logits = logits.masked_fill(~allowed[:, None, :], float("-inf"))
    sink = sinks.view(1, -1, 1).expand(q.shape[0], -1, 1)
    probs = torch.cat([logits.float(), sink], -1).softmax(-1)[..., :-1].to(q.dtype)
    return torch.einsum("nhl,nld->nhd" if batched else "nhl,ld->nhd", probs, keys)
