"""The CPU backend: one C++ kernel per layer for every sequence of the step (prefill,
chunked continuation, prefix hit, decode), reading KV blocks in place through the block
table (openinfer/kernels/cpu_attention.py). Nothing is gathered or padded."""

from __future__ import annotations

import torch

from openinfer.attention.backend import AttentionBackend
from openinfer.attention.metadata import AttentionMetadata
from openinfer.kernels import paged_attention as torch_kernels
from openinfer.kernels.cpu_attention import load_cpu_attention, paged_attention


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """The step's K/V into their slots: one C++ call where the extension reads these tensors
    as they are (K/V rows of adjacent heads in the cache's dtype), else torch's index_copy_."""
    module = load_cpu_attention()
    if (module is not None and k.dtype == v.dtype == cache.dtype
            and k.stride()[1:] == (k.shape[2], 1) and v.stride()[1:] == (v.shape[2], 1)
            and cache.stride()[2:] == (cache.shape[3] * cache.shape[4], cache.shape[4], 1)):
        module.write_kv(cache, k, v, slot_mapping)
    else:
        torch_kernels.write_kv(cache, k, v, slot_mapping)


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
