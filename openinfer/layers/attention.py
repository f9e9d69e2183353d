"""Attention over the paged KV cache, and the per-step metadata that drives it.

A step packs all scheduled tokens into one flat batch (no padding). Sequences are
ordered decodes first (one query token each), then prefills (a prompt chunk each):

    tokens:  | d0 | d1 | d2 | p0 p0 p0 p0 p0 | p1 p1 p1 |
             '-- decodes --'  '---------- prefills ----------'

For every sequence, ``seq_len`` counts its cached tokens plus this step's, so a
chunked-prefill continuation is a prefill whose ``seq_len`` exceeds its query length:

    p0:  [ cached (earlier chunks) | this chunk ]
         0                   seq_len - query_len  seq_len
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from openinfer.kernels.paged_attention import (
    decode_attention,
    gather_kv,
    prefill_attention,
    write_kv,
)


@dataclass
class PrefillSeq:
    query_start: int
    query_len: int
    seq_len: int
    block_table: torch.Tensor
    """[num_blocks] int64 block ids of the sequence."""


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[T] cache slot (block id * block_size + offset) of each token's K/V."""
    num_decodes: int
    """The first ``num_decodes`` tokens are single-token queries of distinct sequences."""
    decode_block_tables: torch.Tensor
    """[num_decodes, max_blocks] int64, padded with 0."""
    decode_mask: torch.Tensor
    """[num_decodes, 1, 1, max_blocks * block_size]: True for key positions inside the
    sequence (built once per step, shared by every layer)."""
    prefills: list[PrefillSeq]


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Turn per-sequence ints into the step's attention tensors.

    Sequences must be ordered decodes (query_len == 1) first.
    """
    slots: list[int] = []
    num_decodes = 0
    prefills: list[PrefillSeq] = []
    start = 0
    for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables):
        for pos in range(seq_len - query_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        if query_len == 1 and not prefills:
            num_decodes += 1
        else:
            prefills.append(PrefillSeq(start, query_len, seq_len,
                                       torch.tensor(table, dtype=torch.long, device=device)))
        start += query_len

    decode_lens = seq_lens[:num_decodes]
    max_blocks = max((len(t) for t in block_tables[:num_decodes]), default=0)
    padded = [t + [0] * (max_blocks - len(t)) for t in block_tables[:num_decodes]]

    def as_long(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    positions = torch.arange(max_blocks * block_size, device=device)
    decode_mask = positions[None, :] < as_long(decode_lens)[:, None]
    return AttentionMetadata(
        slot_mapping=as_long(slots),
        num_decodes=num_decodes,
        decode_block_tables=as_long(padded).view(num_decodes, max_blocks),
        decode_mask=decode_mask[:, None, None, :],
        prefills=prefills,
    )


class Attention(nn.Module):
    """Stores this step's K/V in the paged cache, then attends over each sequence's context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, H, D]; cache: this layer's [2, num_blocks, bs, H, D]."""
        write_kv(cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = decode_attention(q[:nd], cache, meta.decode_block_tables, meta.decode_mask,
                                        self.scale)
        for seq in meta.prefills:
            s, n = seq.query_start, seq.query_len
            if seq.seq_len == n:
                # Nothing cached before this chunk: attend to the fresh K/V directly.
                k_ctx, v_ctx = k[s:s + n], v[s:s + n]
            else:
                k_ctx, v_ctx = gather_kv(cache, seq.block_table, seq.seq_len)
            out[s:s + n] = prefill_attention(q[s:s + n], k_ctx, v_ctx, self.scale)
        return out
