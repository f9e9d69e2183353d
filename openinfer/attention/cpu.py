"""The CPU backend: one C++ kernel per layer for every sequence of the step (prefill,
chunked continuation, prefix hit, decode), reading KV blocks in place through the block
table (openinfer/kernels/cpu_attention.py). Nothing is gathered or padded."""

from __future__ import annotations

import torch

from openinfer.attention.backend import AttentionBackend
from openinfer.attention.metadata import AttentionMetadata
from openinfer.kernels.cpu_attention import paged_attention
from openinfer.kernels.paged_attention import write_kv


class CPUAttentionBackend(AttentionBackend):
    name = "cpu"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        write_kv(cache, k, v, meta.slot_mapping)
        return self.attend(q, cache, meta, scale, window, softcap, sinks)

    def attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, window: int = 0, softcap: float = 0.0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        q = q.to(cache.dtype).contiguous()
        out = torch.empty_like(q)
        paged_attention(out, q, cache[0], cache[1], meta.block_tables, meta.query_start_loc,
                        meta.seq_lens, scale, meta.max_query_len, window=window, softcap=softcap,
                        sinks=sinks)
        return out

    def forward_batch_invariant(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                cache: torch.Tensor, meta: AttentionMetadata,
                                scale: float) -> torch.Tensor:
        # The kernel's invariant mode: no split-KV, no shared-prefix items, one score path.
        write_kv(cache, k, v, meta.slot_mapping)
        q = q.to(cache.dtype).contiguous()
        out = torch.empty_like(q)
        paged_attention(out, q, cache[0], cache[1], meta.block_tables, meta.query_start_loc,
                        meta.seq_lens, scale, meta.max_query_len, invariant=True)
        return out
