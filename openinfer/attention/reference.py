"""The torch reference backend: correct everywhere, fast nowhere.

Decodes attend together over their gathered, padded blocks (one SDPA with a length mask);
each prefill attends alone, over its fresh K/V or, when it has cached context, over its
gathered blocks. Every faster backend is tested against this one.
"""

from __future__ import annotations

import torch

from openinfer.attention.base import AttentionBackend, AttentionMetadata
from openinfer.kernels.cpu_attention import masked_attention
from openinfer.kernels.kv_quant import is_fp8
from openinfer.kernels.paged_attention import (
    batch_invariant_attention,
    decode_attention,
    gather_kv,
    prefill_attention,
    write_kv,
)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        write_kv(cache, k, v, meta.slot_mapping, k_scale, v_scale)
        scales = (k_scale, v_scale)
        if window or softcap or sinks is not None:
            return self._attend_variant(q, cache, meta, scale, window, softcap, sinks, scales)
        # A float8 cache's values are what attention sees: never the step's own unstored K/V.
        return self._attend(q, cache, meta, scale, None if is_fp8(cache.dtype) else (k, v), scales)

    @staticmethod
    def _attend_variant(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, window: int, softcap: float,
                        sinks: torch.Tensor | None, scales: tuple[float, float]) -> torch.Tensor:
        """Windowed, soft-capped or sinked attention: each sequence alone, explicit scores over
        the blocks from its first query's window on."""
        out = torch.empty_like(q)
        starts = meta.derived.setdefault("query_starts", meta.query_start_loc.tolist())
        bs = meta.block_size
        for i in range(meta.num_seqs):
            s, n, seq_len = starts[i], meta.query_lens_list[i], meta.seq_lens_list[i]
            first = max(0, seq_len - n - window + 1) // bs if window else 0
            table = meta.block_tables[i, first:].long()
            k_ctx, v_ctx = gather_kv(cache, table, seq_len - first * bs, *scales)
            out[s:s + n] = masked_attention(q[s:s + n], k_ctx, v_ctx, scale, window, softcap,
                                            sinks, first * bs).to(q.dtype)
        return out

    def attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        return self._attend(q, cache, meta, scale, None, (k_scale, v_scale))

    def _attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                fresh: tuple[torch.Tensor, torch.Tensor] | None,
                scales: tuple[float, float]) -> torch.Tensor:
        """``fresh``: the step's own K/V, which a prefill with nothing cached attends to directly."""
        out = q.new_empty(*q.shape[:-1], cache.shape[-1])
        nd = meta.num_decodes
        if nd:
            tables, mask = self._decode_inputs(meta)
            out[:nd] = decode_attention(q[:nd], cache, tables, mask, scale, *scales)
        starts = meta.derived.setdefault("query_starts", meta.query_start_loc.tolist())
        for i in range(nd, meta.num_seqs):
            s, n, seq_len = starts[i], meta.query_lens_list[i], meta.seq_lens_list[i]
            if seq_len == n and fresh is not None:
                # Nothing cached before this chunk: attend to the fresh K/V directly.
                k_ctx, v_ctx = fresh[0][s:s + n], fresh[1][s:s + n]
            else:
                k_ctx, v_ctx = gather_kv(cache, meta.block_tables[i].long(), seq_len, *scales)
            out[s:s + n] = prefill_attention(q[s:s + n], k_ctx, v_ctx, scale)
        return out

    def forward_batch_invariant(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                                k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        # SDPA is not batch-invariant: its kernels depend on the padded length of the decodes and
        # on a prefill chunk's row count.
        write_kv(cache, k, v, meta.slot_mapping, k_scale, v_scale)
        return batch_invariant_attention(q, cache, meta.block_tables, meta.query_lens_list,
                                         meta.seq_lens_list, scale, k_scale, v_scale)

    @staticmethod
    def _decode_inputs(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The decodes' block tables (int64, trimmed to their longest) and key mask
        [nd, 1, 1, blocks * block_size], made once per step for every layer."""
        cached = meta.derived.get("decode")
        if cached is None:
            nd = meta.num_decodes
            blocks = -(-max(meta.seq_lens_list[:nd]) // meta.block_size)
            tables = meta.block_tables[:nd, :blocks].long()
            positions = torch.arange(blocks * meta.block_size, device=tables.device)
            mask = positions[None, :] < meta.seq_lens[:nd, None]
            cached = meta.derived["decode"] = (tables, mask[:, None, None, :])
        return cached
