"""The Triton backend (CUDA): a KV-write kernel and one paged attention kernel per layer for
every sequence of the step, reading KV blocks in place (openinfer/kernels/triton_attention.py).

The step's program map (which sequence and query tile each program owns, and how decodes are
split over their context) is made once per step from the metadata's Python ints and kept in
``meta.derived``, so the layers only launch kernels. On CPU the same kernels run under
``TRITON_INTERPRET=1`` (tests only: the interpreter is far too slow to serve).
"""

from __future__ import annotations

import torch

from openinfer.attention.base import AttentionBackend, AttentionMetadata
from openinfer.kernels.triton_attention import AttentionPlan, paged_attention, plan_attention, write_kv


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, num_kv_splits: int | None = None) -> None:
        """``num_kv_splits`` forces that many context splits per decode (tests, benchmarks);
        None lets the plan choose from the GPU's SM count."""
        self.num_kv_splits = num_kv_splits

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        write_kv(cache, k, v, meta.slot_mapping, k_scale, v_scale)
        return self._attend(q, cache, meta, scale, window, softcap, sinks, k_scale, v_scale)

    def attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        return self._attend(q, cache, meta, scale, k_scale=k_scale, v_scale=v_scale)

    def _attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, window: int = 0, softcap: float = 0.0,
                sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty_like(q)
        num_kv_heads = cache.shape[3]
        plan = self._plan(meta, q.shape[1] // num_kv_heads, num_kv_heads)
        paged_attention(out, q, cache[0], cache[1], meta.block_tables, meta.query_start_loc,
                        meta.seq_lens, scale, plan, window, softcap, sinks, k_scale, v_scale)
        return out

    def _plan(self, meta: AttentionMetadata, group: int, num_kv_heads: int) -> AttentionPlan:
        """The step's plan for this head geometry, made by the first layer that asks."""
        key = ("triton_plan", group, num_kv_heads)
        plan = meta.derived.get(key)
        if plan is None:
            plan = meta.derived[key] = plan_attention(
                meta.query_lens_list, meta.seq_lens_list, meta.num_decodes, group, num_kv_heads,
                meta.seq_lens.device, self.num_kv_splits)
        return plan
