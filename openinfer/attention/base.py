"""The attention backend interface: what a model's attention layer asks of the hardware.

A backend turns the step's integers into its metadata once per step (``build_metadata``)
and then, for every layer, stores the step's K/V in that layer's paged cache and attends
(``forward``). Backends: ``torch`` (the reference: gathers each sequence's blocks and runs
SDPA; the oracle every other backend is tested against) and ``cpu`` (one C++ kernel for
prefill, chunked prefill, prefix hits and decode, reading blocks in place).

A layer's cache is ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = K, 1 = V),
a strided view of the engine's block-major tensor: each block's ``[block_size, H, D]`` is
contiguous, consecutive blocks are not.

The step's attention metadata: built once per step from the scheduler's integers and
shared by every layer, so no layer loops over sequences in Python to find its inputs.

A step packs all scheduled tokens into one flat batch (no padding), decodes first (one
query token each), then prefills (a prompt chunk each):

    tokens:           | d0 | d1 | d2 | p0 p0 p0 p0 p0 | p1 p1 p1 |
    query_start_loc:  0    1    2    3                8          11

For every sequence, ``seq_len`` counts its cached tokens plus this step's, so a
chunked-prefill continuation or a prefix-cache hit is a prefill whose ``seq_len``
exceeds its query length; query ``i`` of a sequence sits at position
``seq_len - query_len + i`` and attends keys ``0 ..`` that position:

    p0:  [ cached (earlier chunks, prefix hits) | this chunk ]
         0                         seq_len - query_len     seq_len
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch


class AttentionLayerShape(Protocol):
    """What a backend reads of an attention layer (openinfer.layers.attention.Attention)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int
    logit_softcap: float
    sinks: torch.Tensor | None
    rope_kernels: dict


class RotaryTables(Protocol):
    """What a backend reads of a rotary embedding (openinfer.layers.rotary)."""

    cpu_kernels: Any
    interleaved: bool
    rotary_dim: int
    head_dim: int
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor


class NormWeights(Protocol):
    """What a backend reads of an RMSNorm (openinfer.layers.norm)."""

    cpu_kernels: Any
    weight: torch.Tensor
    eps: float


class AttentionBackend(ABC):
    name: str

    def build_metadata(self, query_lens: list[int], seq_lens: list[int],
                       block_tables: list[list[int]], block_size: int,
                       device: torch.device | str) -> AttentionMetadata:
        """The step's metadata (sequences ordered decodes first)."""
        return build_attention_metadata(self, query_lens, seq_lens, block_tables, block_size,
                                        device)

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        """Write k/v ([T, Hkv, D]) into ``cache`` at ``meta.slot_mapping``, then return the
        attention of q ([T, Hq, D]) over each sequence's cached context, [T, Hq, D], in q's
        dtype. Every key and value is read back from the cache, the step's own included.

        A layer's variants: ``window`` > 0, query ``p`` sees keys ``p - window + 1 .. p``
        only (and never reads table entries before that: they may be released); ``softcap``
        > 0, scaled scores ``s`` become ``softcap * tanh(s / softcap)``; ``sinks`` [Hq], one
        logit per query head in the softmax denominator, with no value. A float8 cache
        (``--kv-cache-dtype``) stores k / ``k_scale`` and v / ``v_scale``
        (openinfer/kernels/kv_quant.py)."""

    @abstractmethod
    def attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """The attention of q ([T, Hq, D]) over each sequence's context, already in ``cache``
        (any ``[2, num_blocks, block_size, Hkv, D]`` view: MLA passes its latent entries as
        both K and V, one expanded view), [T, Hq, D] in q's dtype."""

    def rope_attention(self, layer: AttentionLayerShape, positions: torch.Tensor, qkv: torch.Tensor,
                       rotary: RotaryTables, q_norm: NormWeights | None, k_norm: NormWeights | None,
                       cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """``layer.forward_qkv`` in one call, or None where this backend does not fuse it
        (the layer then splits, rotates and calls ``forward``)."""
        return None

    def forward_batch_invariant(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                                k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """``forward``, with each query row's result bitwise independent of the rest of the
        step (other sequences, its own prompt's chunking, padding): ``--batch-invariant``."""
        raise NotImplementedError(f"attention backend {self.name!r} has no batch-invariant mode")


@dataclass
class AttentionMetadata:
    backend: AttentionBackend
    """The backend that built this metadata and runs every layer's attention with it."""
    slot_mapping: torch.Tensor
    """[T] int64: the cache slot (block id * block_size + offset) of each token's K/V."""
    query_start_loc: torch.Tensor
    """[B + 1] int32: sequence b's query tokens are rows query_start_loc[b] .. [b + 1]."""
    seq_lens: torch.Tensor
    """[B] int32: cached + this step's tokens of each sequence."""
    block_tables: torch.Tensor
    """[B, max_blocks] int32, padded with 0 (never read past a sequence's seq_len); entries
    released behind a sliding window (kv.spec.SKIPPED) read 0 too, and are never read."""
    num_decodes: int
    """The first ``num_decodes`` sequences (and tokens) are single-token queries."""
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_lens_list: list[int]
    seq_lens_list: list[int]
    """The same lengths as Python ints (backends that loop over sequences read these)."""
    derived: dict[str, Any] = field(default_factory=dict)
    """A backend's own per-step tensors, made on first use by the first layer."""
    context_parallel: Any = None
    """Prefill context parallelism: the step's split (a ContextParallelStep), whose K/V
    exchange each attention layer runs before attending; None otherwise."""
    prefill_ends: list[int] | None = None
    """Per sequence: the position its prefill ends at (all its known tokens: a prompt, or a
    preempted request's prompt and output), or -1 where every prefill row must be computed
    (prompt logprobs); None: not given. A model whose upper layers need only a prefill's last
    rows (DeepSeek-V4.1's bounded replay) skips the others."""

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    def decodes(self) -> AttentionMetadata:
        """The metadata of this step's decodes alone (its first ``num_decodes`` sequences and
        tokens), made once per step: for layers that attend to decodes another way than to
        prefills (MLA: absorbed vs expanded)."""
        nd = self.num_decodes
        if nd == self.num_seqs:
            return self
        sub = self.derived.get("decodes")
        if sub is None:
            sub = self.derived["decodes"] = AttentionMetadata(
                backend=self.backend, slot_mapping=self.slot_mapping[:nd],
                query_start_loc=self.query_start_loc[:nd + 1], seq_lens=self.seq_lens[:nd],
                block_tables=self.block_tables[:nd], num_decodes=nd, max_query_len=min(nd, 1),
                max_seq_len=max(self.seq_lens_list[:nd], default=0), block_size=self.block_size,
                query_lens_list=self.query_lens_list[:nd], seq_lens_list=self.seq_lens_list[:nd])
        return sub

    def gathered_prefills(self) -> tuple[torch.Tensor, AttentionMetadata]:
        """The prefills over a copy of their own context, made once per step: the ids of the
        blocks they read, in order (int64 [n]), and the prefills' metadata with block tables
        into that copy (``cache.index_select(0, ids)``: sequence i's blocks are consecutive
        rows of it). For layers that compute their keys from the cache and attend to those
        (MLA's expanded form: one GEMM over every prefill's context, one backend call)."""
        cached = self.derived.get("gathered_prefills")
        if cached is None:
            nd, bs = self.num_decodes, self.block_size
            counts = np.asarray([-(-n // bs) for n in self.seq_lens_list[nd:]], dtype=np.int64)
            firsts = np.concatenate(([0], np.cumsum(counts)[:-1]))
            columns = np.arange(max(counts, default=1))
            tables = np.where(columns[None, :] < counts[:, None], firsts[:, None] + columns[None, :], 0)
            device = self.block_tables.device
            ids = torch.cat([self.block_tables[nd + i, :c] for i, c in enumerate(counts.tolist())])
            query_lens, seq_lens = self.query_lens_list[nd:], self.seq_lens_list[nd:]
            prefills = AttentionMetadata(
                backend=self.backend, slot_mapping=self.slot_mapping[nd:],
                query_start_loc=self.query_start_loc[nd:] - nd, seq_lens=self.seq_lens[nd:],
                block_tables=torch.from_numpy(tables).to(device=device, dtype=torch.int32),
                num_decodes=0, max_query_len=max(query_lens, default=0),
                max_seq_len=max(seq_lens, default=0), block_size=bs,
                query_lens_list=query_lens, seq_lens_list=seq_lens)
            cached = self.derived["gathered_prefills"] = (ids.long(), prefills)
        return cached


def build_attention_metadata(
    backend: AttentionBackend,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """The step's tensors from per-sequence ints (sequences ordered decodes first).

    The slot mapping is computed with numpy over the whole batch: a token's block is
    ``table[position // block_size]`` of its sequence.
    """
    num_seqs = len(query_lens)
    q_lens = np.asarray(query_lens, dtype=np.int64)
    s_lens = np.asarray(seq_lens, dtype=np.int64)
    starts = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=starts[1:])
    max_blocks = max((len(t) for t in block_tables), default=0)
    tables = np.zeros((num_seqs, max(max_blocks, 1)), dtype=np.int64)
    for i, table in enumerate(block_tables):
        tables[i, :len(table)] = table

    seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
    positions = (np.arange(int(starts[-1])) - starts[:-1][seq_of_token]
                 + (s_lens - q_lens)[seq_of_token])
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    if tables.min() < 0:  # entries released behind a sliding window: never read
        assert slots.min() >= 0, "a token's KV slot lies in a released block"
        np.maximum(tables, 0, out=tables)
    num_decodes = 0
    while num_decodes < num_seqs and query_lens[num_decodes] == 1:
        num_decodes += 1

    def tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(array).to(device=device, dtype=dtype)

    return AttentionMetadata(
        backend=backend,
        slot_mapping=tensor(slots, torch.long),
        query_start_loc=tensor(starts, torch.int32),
        seq_lens=tensor(s_lens, torch.int32),
        block_tables=tensor(tables, torch.int32),
        num_decodes=num_decodes,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        block_size=block_size,
        query_lens_list=list(query_lens),
        seq_lens_list=list(seq_lens),
    )
